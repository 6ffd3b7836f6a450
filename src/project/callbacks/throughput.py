"""Lightning's ThroughputMonitor, told how to count the samples of any batch this template's data gives, and the
FLOPs of any model.

Lightning reports FLOPs and MFU only for a LightningModule with a `flops_per_batch` attribute, which users rarely
write. Here, unless the module has one, the first training batch's forward, loss and backward are counted with
torch's FlopCounterMode (matrix products, convolutions, attention: the operations that dominate, as
`lightning.fabric.utilities.throughput.measure_flops` counts them), on rank 0, and that count is the module's
`flops_per_batch` from then on. It counts what this process's thread runs: dp's replicas and pipe's stages run in
threads of their own, so there it is refused, and the module's own number is the way.

MFU divides by the device's peak from Lightning's table (the datasheets' figures). Lightning 2.6 does not recognise
an H200 by the name CUDA gives it ("NVIDIA H200"; it looks for "sxm1" or "nvl1"), so that name is looked up here in
its table; `peak_flops` sets the peak for any other device, or a different figure (a dense rather than sparse peak).
"""

import logging
import warnings
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor as _ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only
from torch.utils._pytree import tree_leaves

from project.errors import UserError

log = logging.getLogger(__name__)


def samples_in(batch: Any) -> int:
    """The leading dimension of the first tensor in the batch ((images, labels), a dict, a tensor): torch's pytree
    walks the collections, as project.strategies.pieces.first_tensor does."""
    first = next((leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim), None)
    if first is None:
        raise UserError(f"callbacks.throughput: no tensor in a {type(batch).__name__} batch to count samples by")
    return int(first.shape[0])


class ThroughputMonitor(_ThroughputMonitor):
    """`batch_size_fn` filled in (a config cannot pass a function); the options spelled out, so a mistyped one is
    refused by name at start (Lightning's take **kwargs). `count_flops`: count the first batch's FLOPs when the
    module has no `flops_per_batch` of its own; `peak_flops`: one device's peak FLOP/s for MFU, in place of
    Lightning's table (the module docstring)."""

    def __init__(
        self, window_size: int = 10, separator: str = "/", count_flops: bool = True, peak_flops: float | None = None
    ) -> None:
        if window_size < 2:
            raise UserError(f"callbacks.throughput.window_size={window_size!r}: at least 2 steps")
        number = isinstance(peak_flops, (int, float)) and not isinstance(peak_flops, bool)
        if peak_flops is not None and not (number and peak_flops > 0):
            raise UserError(f"callbacks.throughput.peak_flops={peak_flops!r}: one device's peak FLOP/s, e.g. 9.89e14")
        super().__init__(batch_size_fn=samples_in, window_size=window_size, separator=separator)
        self.count_flops = count_flops
        self.peak_flops = peak_flops
        self._counter: Any = None  # torch's FlopCounterMode while the first batch runs

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        device = trainer.strategy.root_device
        peak = self.peak_flops or _peak_lightning_misses(device, _plugin_to_compute_dtype(trainer.precision_plugin))
        with warnings.catch_warnings():
            if peak:  # Lightning's "FLOPs not found for ..." would be wrong: there is a peak
                warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        if peak:
            self.available_flops = int(peak)
            for throughput in self._throughputs.values():
                throughput.available_flops = self.available_flops
        if self._counts(pl_module) and stage == "fit":
            from project.strategies.one_process import OneProcessStrategy

            if isinstance(trainer.strategy, OneProcessStrategy):
                name = type(trainer.strategy).__name__
                raise UserError(
                    f"callbacks.throughput.count_flops: {name} computes in threads of its own, which a FLOP counter "
                    f"does not see; give {type(pl_module).__name__} a flops_per_batch attribute (FLOPs of one "
                    "batch's forward and backward), or set callbacks.throughput.count_flops=false"
                )

    def _counts(self, pl_module: L.LightningModule) -> bool:
        return self.count_flops and not hasattr(pl_module, "flops_per_batch")

    @rank_zero_only
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self._counts(pl_module) and self._counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if self._counter is not None:
            flops = self._stop_counting()
            if flops:
                setattr(pl_module, "flops_per_batch", flops)  # what Lightning reads (the module docstring)
                log.info(f"Throughput: one training batch costs {flops:,} FLOPs (forward and backward, counted once)")
            else:
                self.count_flops = False
                log.warning(
                    "Throughput: no FLOPs counted in the first training batch (no matrix product or convolution ran "
                    f"in this thread); give {type(pl_module).__name__} a flops_per_batch attribute for FLOPs and MFU"
                )
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:  # the mode must not outlive the batch it counted
            self._stop_counting()

    def _stop_counting(self) -> int:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        return int(counter.get_total_flops())


def _peak_lightning_misses(device: torch.device, dtype: torch.dtype) -> float | None:
    """An H200's peak from Lightning's own table, under the name CUDA gives it (the module docstring)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    if "h200" not in name:
        return None
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS

    table = _CUDA_FLOPS.get("h200 nvl1" if "nvl" in name else "h200 sxm1", {})
    key: Any = dtype
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        key = "tfloat32"  # what Lightning takes for float32 matrix products on TF32 tensor cores
    return table.get(key)
