"""Test-only callbacks for tests/test_pipeline.py, importable by the rank processes a CLI run starts
(tests/ is on their PYTHONPATH): what each rank saw, written to $PROBE_DIR."""

import json
import os
import time
from pathlib import Path

import lightning.pytorch as L
import torch

from project.data.digits import DigitsDataModule


def probe_dir() -> Path:
    return Path(os.environ["PROBE_DIR"])


class StepProbe(L.Callback):
    """Per rank: the loss of every training batch (averaged over data-parallel pipelines: the global batch's) and
    the final callback_metrics, in rank<r>.json. Rank 0 also writes the whole net's weights (weights.pt),
    gathered from every stage by the strategy's checkpoint code on pipeline runs, as they are on one device."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_fit_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # a collective on pipeline runs: every rank calls it
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        out = {"losses": self.losses, "metrics": metrics, "global_step": trainer.global_step}
        (probe_dir() / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
        if trainer.is_global_zero:
            weights = {k.removeprefix("net."): v.detach().cpu() for k, v in state.items() if k.startswith("net.")}
            torch.save(weights, probe_dir() / "weights.pt")


class SkewedDigits(DigitsDataModule):
    """Rank 1 reads batches one sample smaller than rank 0's: what a data module that ignores the strategy's
    sampler arguments does to a pipeline, whose stages must all see the same batches."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.trainer is not None and self.trainer.global_rank == 1:
            self.batch_size -= 1


class Throughput(L.Callback):
    """Rank 0 writes training samples per second over the batches after the first `warmup` (which include
    torch's shape inference and first-touch allocations) to $PROBE_DIR/throughput.json."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.sizes.append(len(batch[0]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and len(self.ends) > self.warmup + 1:
            seconds = self.ends[-1] - self.ends[self.warmup]
            samples = sum(self.sizes[self.warmup + 1 :])
            out = {"samples_per_s": samples / seconds, "batches": len(self.ends) - self.warmup - 1}
            (probe_dir() / "throughput.json").write_text(json.dumps(out))
