"""Lightning's ThroughputMonitor, told how to count the samples of any batch this template's data gives."""

from typing import Any

import torch
from lightning.pytorch.callbacks import ThroughputMonitor as _ThroughputMonitor


def samples_in(batch: Any) -> int:
    """The leading dimension of the first tensor in the batch: (images, labels), a dict, or a tensor alone."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = samples_in(item) if isinstance(item, (torch.Tensor, list, tuple, dict)) else 0
        if found:
            return found
    raise TypeError(f"callbacks.throughput: no tensor in a batch of type {type(batch).__name__} to count samples by")


class ThroughputMonitor(_ThroughputMonitor):
    """`batch_size_fn` filled in (the config cannot name a function to pass)."""

    def __init__(self, window_size: int = 10, **kwargs: Any) -> None:
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"callbacks.throughput.window_size={window_size!r}: at least 2 steps")
        super().__init__(batch_size_fn=samples_in, window_size=window_size, **kwargs)
