"""Test-only instruments for the DDP CLI test: they write what each rank saw into $PROBE_DIR."""

import hashlib
import json
import os
from pathlib import Path

import lightning.pytorch as L
import torch

from project.data.digits import DigitsDataModule


def fingerprint(image: torch.Tensor) -> str:
    return hashlib.sha1(image.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def probe_dir() -> Path:
    return Path(os.environ["PROBE_DIR"])


class CountingDigits(DigitsDataModule):
    """Digits that append a line per prepare_data call, naming the calling rank."""

    def prepare_data(self) -> None:
        super().prepare_data()
        with open(probe_dir() / "prepare_data.calls", "a") as f:
            f.write(f"{self.trainer.global_rank if self.trainer else 'none'}\n")


class ShardProbe(L.Callback):
    """Per rank: the fingerprints of every training sample, per epoch, in order; and the final metrics."""

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, _ = batch
        self.seen.setdefault(trainer.current_epoch, []).extend(fingerprint(x) for x in images)

    def on_fit_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        out = {"rank": trainer.global_rank, "world_size": trainer.world_size, "seen": self.seen, "metrics": metrics}
        (probe_dir() / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
