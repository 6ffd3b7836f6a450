"""A Lightning callback that times each epoch inside a real `train.py` run, so process start-up and imports stay
out of per-epoch figures: `+callbacks.epoch_timer._target_=epoch_timer.EpochTimer
+callbacks.epoch_timer.path=<file.json>` with benchmarks/ on PYTHONPATH (timing.python_env)."""

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch


class EpochTimer(L.Callback):
    """Rank 0 writes, per epoch: `train_s` (first batch fetched to the last training step's hooks done),
    `epoch_s` (epoch start to the next epoch's start, or fit end: validation and checkpoint writes included) and
    `samples` (training samples over all ranks). On a CUDA GPU each of these times is read once the device has done
    the work queued before it (one synchronisation at an epoch's start, last step and end: the GPU runs behind the
    host, and a time read without it would miss the epoch's last kernels)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.epochs: list[dict[str, float]] = []
        self._start = self._train_end = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = _settled(pl_module)
        self._close_epoch(trainer, now)
        self._start, self._samples = now, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int):
        self._samples += len(batch[1]) * trainer.world_size
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self._train_end = _settled(pl_module) if last else time.perf_counter()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_epoch(trainer, _settled(pl_module))
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"world_size": trainer.world_size, "epochs": self.epochs}) + "\n")

    def _close_epoch(self, trainer: L.Trainer, now: float) -> None:
        if self._samples:
            train_s, epoch_s = self._train_end - self._start, now - self._start
            self.epochs.append({"train_s": train_s, "epoch_s": epoch_s, "samples": self._samples})
            self._samples = 0


def _settled(pl_module: L.LightningModule) -> float:
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)
    return time.perf_counter()
