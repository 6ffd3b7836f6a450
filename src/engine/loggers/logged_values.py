"""Lightning moves each `self.log` result object to the value's device on every call, rebuilding its `__dict__`: most
of the call's cost (168 µs vs 21-24 µs, benchmarks/per_call.py), though after the first call it is always there.
`skip_needless_moves` returns at once when everything it holds is already on that device.
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
