"""Lightning's ThroughputMonitor, counting any batch's samples and, with torch's FlopCounterMode on each stage's first
batch, the FLOPs Lightning takes only from a module's `flops_per_batch` (one number for every stage). Lightning 2.6's
peak table misses an H200 by CUDA's name ("NVIDIA H200"; it looks for "sxm1" or "nvl1"), so it is looked up here.
"""

import logging
import math
import warnings
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor as _ThroughputMonitor
from lightning.pytorch.utilities import rank_zero_only
from torch.utils._pytree import tree_leaves

from engine.errors import UserError

log = logging.getLogger(__name__)
_NAMES = {"train": "training", "validate": "validation", "test": "test", "predict": "prediction"}  # stages, in words


def samples_in(batch: Any) -> int:
    """The leading dimension of the first tensor in the batch ((images, labels), a dict, a tensor): torch's pytree
    walks the collections, as engine.strategies.pieces.first_tensor does."""
    first = next((leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim), None)
    if first is None:
        raise UserError(f"callbacks.throughput: no tensor in a {type(batch).__name__} batch to count samples by")
    return int(first.shape[0])


class ThroughputMonitor(_ThroughputMonitor):
    """`batch_size_fn` filled in, options spelled out so a mistyped one is refused by name (Lightning's take **kwargs).
    `count_flops`: when the module has no `flops_per_batch`; `peak_flops`: one device's FLOP/s for MFU."""

    def __init__(
        self, window_size: int = 10, separator: str = "/", count_flops: bool = True, peak_flops: float | None = None
    ) -> None:
        if window_size < 2:
            raise UserError(f"callbacks.throughput.window_size={window_size!r}: at least 2 steps")
        number = isinstance(peak_flops, (int, float)) and not isinstance(peak_flops, bool)
        if peak_flops is not None and not (number and MIN_PEAK <= peak_flops < math.inf):
            raise UserError(
                f"callbacks.throughput.peak_flops={peak_flops!r}: one device's peak FLOP/s, at least {MIN_PEAK:.0e} "
                "(e.g. 9.89e14 for an H100's dense bf16)"
            )
        super().__init__(batch_size_fn=samples_in, window_size=window_size, separator=separator)
        self.window_size, self.count_flops, self.peak_flops = window_size, count_flops, peak_flops
        self._counted: dict[str, int] = {}  # stage -> FLOPs of one of its batches, as counted here
        self._counter: Any = None  # torch's FlopCounterMode while a stage's first batch runs
        self._counting: Any = None  # and that stage
        self._users_own = False  # the module came with its own flops_per_batch
        self._restart_window: Any = None  # a stage whose window restarts at its next batch (below)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        device = trainer.strategy.root_device
        peak = self.peak_flops or _peak_lightning_misses(device, _plugin_to_compute_dtype(trainer.precision_plugin))
        with warnings.catch_warnings():
            if peak:  # Lightning's "FLOPs not found for ..." would be wrong: there is a peak
                warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        loaders = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        for throughput in self._throughputs.values():
            throughput.world_size = int(loaders.get("num_replicas", 1))  # the processes that load their own batches
            if peak:
                throughput.available_flops = peak

    def _begin(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At a fit's or an evaluation's start, after the module's own setup (where Lightning's example sets its
        `flops_per_batch`), on every rank: whose count it is, and whether this strategy lets it be counted."""
        self._users_own = hasattr(pl_module, "flops_per_batch") and not self._counted
        if not self.count_flops and not self._users_own:
            self._module_has_flops = False  # turned off on purpose: no Lightning warning asking for the attribute
        if self._counts():
            _refuse_where_a_counter_cannot_see(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._begin(trainer, pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "fit":  # inside a fit: decided at its start
            self._begin(trainer, pl_module)
        super().on_validation_start(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._begin(trainer, pl_module)
        super().on_test_start(trainer, pl_module)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._begin(trainer, pl_module)
        super().on_predict_start(trainer, pl_module)

    def _counts(self) -> bool:
        return self.count_flops and not self._users_own

    def _start_counting(self, trainer: L.Trainer) -> None:
        stage = trainer.state.stage
        if self._counter is not None and self._counting != stage:  # a batch that never ended (a skipped epoch)
            self._stop_counting()
        if self._counts() and self._counter is None and stage not in self._counted and not trainer.sanity_checking:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter, self._counting = FlopCounterMode(display=False), stage
            self._counter.__enter__()

    def _counts_for(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Before Lightning reads `flops_per_batch` for a batch: this stage's count (counted now if it is its first)."""
        stage = trainer.state.stage
        assert stage is not None
        if self._restart_window == stage:
            self._restart_window = None
            self._throughputs[stage].reset()
        if not self._counts():
            return
        if self._counter is not None and self._counting == stage:
            flops = self._stop_counting()
            self._counted[stage] = flops
            if _compiled(pl_module):  # torch does not compile under a counter: the next batch compiles, untimed
                self._restart_window = stage
            if flops:
                what = "forward and backward" if stage == "train" else "forward"
                log.info(f"Throughput: one {_NAMES[stage.value]} batch costs {flops:,} FLOPs ({what}, counted once)")
            else:
                log.warning(
                    f"Throughput: no FLOPs counted in the first {_NAMES[stage.value]} batch (no matrix product or "
                    f"convolution ran in this thread); give {type(pl_module).__name__} a flops_per_batch attribute"
                )
        flops = self._counted.get(stage, 0)
        if flops:
            setattr(pl_module, "flops_per_batch", flops)  # what Lightning reads (the module docstring)
        elif hasattr(pl_module, "flops_per_batch"):
            delattr(pl_module, "flops_per_batch")  # another stage's count is not this one's
        self._module_has_flops = bool(flops)  # Lightning's once-a-run look, for this stage (no warning: said above)

    @rank_zero_only
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        self._start_counting(trainer)

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = on_train_batch_start

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._counts_for(trainer, pl_module)
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    @rank_zero_only
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        if not trainer.sanity_checking:
            self._counts_for(trainer, pl_module)
        super().on_validation_batch_end(trainer, pl_module, *args, **kw)

    @rank_zero_only
    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._counts_for(trainer, pl_module)
        super().on_test_batch_end(trainer, pl_module, *args, **kwargs)

    @rank_zero_only
    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kw: Any) -> None:
        self._counts_for(trainer, pl_module)
        super().on_predict_batch_end(trainer, pl_module, *args, **kw)

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.trainer.states import RunningStage

        batches = self._batches.get(RunningStage.TRAINING, 0)
        if 0 < batches < self.window_size:
            log.info(
                f"Throughput: {batches} training batches, fewer than callbacks.throughput.window_size="
                f"{self.window_size}: no rates were logged"
            )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:  # the mode must not outlive the batch it counted
            self._stop_counting()

    def _stop_counting(self) -> int:
        counter, self._counter, self._counting = self._counter, None, None
        counter.__exit__(None, None, None)
        return int(counter.get_total_flops())


def _compiled(pl_module: L.LightningModule) -> bool:
    """Whether a module of it runs compiled (Module.compile, as model.compile does)."""
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in pl_module.modules())


def _refuse_where_a_counter_cannot_see(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    from engine.strategies.one_process import OneProcessStrategy
    from engine.strategies.pipeline import PipelineStrategy

    name = type(trainer.strategy).__name__
    if isinstance(trainer.strategy, OneProcessStrategy):
        where = f"{name} computes in threads of its own, which a FLOP counter does not see"
    elif isinstance(trainer.strategy, PipelineStrategy):
        where = f"{name} computes each stage in a process of its own; rank 0 would count its own stage alone"
    else:
        return
    raise UserError(
        f"callbacks.throughput.count_flops: {where}; give {type(pl_module).__name__} a flops_per_batch attribute "
        "(the FLOPs one device computes for a batch: its replica's or stage's forward and backward), or set "
        "callbacks.throughput.count_flops=false"
    )


MIN_PEAK = 1e9  # FLOP/s: below any device a net trains on (peak_flops=1 made an MFU of 3.4e10)


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
