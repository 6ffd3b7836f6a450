"""What a `self.log` call costs, and the part of it a run skips.

Lightning keeps each logged value in a result object (`_ResultMetric`, a torchmetrics Metric) and, on every
`self.log` call, moves that object to the value's device: `_ResultMetric.to` rebuilds its whole `__dict__` through
`apply_to_collection`, and for a logged Metric runs `Module.to` over it: most of a `self.log` call (168 µs of
Lightning's logging a call, 21-24 µs without the move: benchmarks/per_call.py), also when everything is already there,
which after the first call of a run it always is. `skip_needless_moves` makes the move return at once when every
tensor and metric the object holds (directly or in one of its dicts, such as the state defaults) is already on that
device; any other call is Lightning's own. It is installed when the Trainer is built (engine.build.trainer), for
the template's module and a user's alike.
"""

from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from torchmetrics import Metric

_lightnings_to = _ResultMetric.to


def _already_on(result: Any, device: torch.device) -> bool:
    for value in vars(result).values():
        for item in value.values() if isinstance(value, dict) else (value,):
            if isinstance(item, (torch.Tensor, Metric)) and item.device != device:
                return False
    return True


def _to(self: _ResultMetric, *args: Any, **kwargs: Any) -> _ResultMetric:
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.device) and _already_on(self, args[0]):
        return self
    return _lightnings_to(self, *args, **kwargs)


def skip_needless_moves() -> None:
    """Idempotent; process-wide (a ddp_spawn child runs without it: slower, not different)."""
    _ResultMetric.to = _to  # type: ignore[method-assign]
