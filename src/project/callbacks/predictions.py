"""predictions.csv: one row per input in input order, written once by rank 0 whatever the strategy.

Under ddp each rank predicts its own shard (Lightning's DistributedSampler, which pads the last shard by
repeating inputs); every rank's (index, probabilities) are gathered on rank 0, which drops the repeats and
sorts by index.
"""

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor


class PredictionsCSV(L.Callback):
    """Collects what `predict_step` returns for batches of (images, indices) and writes `path` at the end:
    file, predicted class, then the probability of each class."""

    def __init__(self, path: Path, names: Sequence[str], classes: Sequence[str]) -> None:
        self.path, self.names, self.classes = path, list(names), list(classes)
        self.indices: list[Tensor] = []
        self.probabilities: list[Tensor] = []

    def on_predict_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self.indices.append(batch[1].detach().cpu())
        self.probabilities.append(outputs.detach().float().cpu())

    def _gathered(self, trainer: L.Trainer) -> tuple[Tensor, Tensor]:
        mine = (torch.cat(self.indices), torch.cat(self.probabilities))
        if trainer.world_size < 2:
            return mine
        import torch.distributed as dist

        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, mine)  # shards may differ in length: objects, not one tensor
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        indices, probabilities = self._gathered(trainer)
        if not trainer.is_global_zero:
            return
        rows = dict(zip(indices.tolist(), probabilities.tolist()))  # a repeated index repeats the same input
        if sorted(rows) != list(range(len(self.names))):
            raise RuntimeError(f"predictions for {len(rows)} of {len(self.names)} inputs")
        with open(self.path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["file", "predicted", *(f"prob_{c}" for c in self.classes)])
            for i, name in enumerate(self.names):
                probs = rows[i]
                best = max(range(len(probs)), key=probs.__getitem__)
                writer.writerow([name, self.classes[best], *(f"{p:.6f}" for p in probs)])
