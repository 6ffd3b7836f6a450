"""Lightning calls every callback hook on every callback, each wrapped in a profiler action named from its
`state_key`: a few percent of the MLP's 1 ms steps (benchmarks/step_loop.py). Lightning skips a hook that is not
callable, so unused per-batch hooks become None on the instance, and no profiler asked for means one shared no-op.
"""

from contextlib import nullcontext
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.profilers import PassThroughProfiler

# The hooks called once per batch or per optimizer step: the ones whose dispatch adds up. Hooks called once per
# epoch or per run are left as they are.
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)

_NOTHING = nullcontext()


class QuietProfiler(PassThroughProfiler):
    """Lightning's default profiler (none), without a generator-based context manager per hook call."""

    def profile(self, action_name: str) -> Any:
        return _NOTHING


def skip_unused_hooks(callbacks: list[Any]) -> None:
    """Per-batch hooks a callback's class leaves as Callback's no-ops become None on the instance, which Lightning
    skips; overridden hooks, and callbacks without an instance dict (`__slots__`), are left as they are."""
    for callback in callbacks:
        own = getattr(callback, "__dict__", None)
        if own is None:
            continue
        for hook in PER_BATCH_HOOKS:
            if hook not in own and getattr(type(callback), hook, None) is getattr(Callback, hook):
                own[hook] = None
