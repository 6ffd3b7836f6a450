"""What Lightning's hook dispatch costs when nothing listens, and how a run avoids paying it.

Lightning calls every callback hook on every callback (`lightning.pytorch.trainer.call._call_callback_hooks`),
whether the callback overrides it or not, and wraps each call in `trainer.profiler.profile(...)` with the
callback's `state_key` formatted into the action name (for ModelCheckpoint a repr of its settings). With the
default 10 callbacks that is about 10 hooks a training step times 10 callbacks, a few microseconds each: on the
MLP's 1 ms steps several percent of the step loop (benchmarks/step_loop.py). Lightning skips a hook whose
attribute is not callable, so the per-batch hooks a callback does not override are set to None on the instance;
the profiler, when none was asked for, enters one shared no-op context instead of building a generator per call.
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
    """Per callback, the per-batch hooks its class leaves as Callback's no-ops become None on the instance, which
    Lightning's dispatch skips. A hook the class (or a parent of it) overrides, or the instance set itself, is
    untouched; a callback without an instance dict (`__slots__`) is left as it is."""
    for callback in callbacks:
        own = getattr(callback, "__dict__", None)
        if own is None:
            continue
        for hook in PER_BATCH_HOOKS:
            if hook not in own and getattr(type(callback), hook, None) is getattr(Callback, hook):
                own[hook] = None
