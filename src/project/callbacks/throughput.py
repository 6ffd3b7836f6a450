"""Lightning's ThroughputMonitor, told how to count the samples of any batch this template's data gives."""

from typing import Any

import torch
from lightning.pytorch.callbacks import ThroughputMonitor as _ThroughputMonitor
from torch.utils._pytree import tree_leaves

from project.errors import UserError


def samples_in(batch: Any) -> int:
    """The leading dimension of the first tensor in the batch ((images, labels), a dict, a tensor): torch's pytree
    walks the collections, as project.strategies.pieces.first_tensor does."""
    first = next((leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim), None)
    if first is None:
        raise UserError(f"callbacks.throughput: no tensor in a {type(batch).__name__} batch to count samples by")
    return int(first.shape[0])


class ThroughputMonitor(_ThroughputMonitor):
    """`batch_size_fn` filled in (a config cannot pass a function); the options spelled out, so a mistyped one is
    refused by name at start (Lightning's take **kwargs)."""

    def __init__(self, window_size: int = 10, separator: str = "/") -> None:
        if window_size < 2:
            raise UserError(f"callbacks.throughput.window_size={window_size!r}: at least 2 steps")
        super().__init__(batch_size_fn=samples_in, window_size=window_size, separator=separator)
