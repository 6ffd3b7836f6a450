"""What `predict_step` returns, one entry per input in input order, written once by rank 0 whatever the strategy:
predictions.pt always, and predictions.csv where each output is a short row of numbers.

Under ddp each rank predicts its own shard (Lightning's DistributedSampler, which pads the last shard by repeating
inputs); every rank's (indices, outputs) are gathered on rank 0, which drops the repeats and puts them in order.
"""

import csv
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from engine.runs.atomic_io import write_file

log = logging.getLogger(__name__)

TENSORS = "predictions.pt"
TABLE = "predictions.csv"
SHORT = 32  # outputs of at most this many numbers per input get a CSV row; longer ones only the tensor file


def _probabilities(rows: Tensor) -> bool:
    return bool((rows >= 0).all() and torch.allclose(rows.sum(1), torch.ones(len(rows)), atol=1e-3))


def columns(outputs: Any, classes: Sequence[str] | None) -> tuple[list[str], list[list[str]]] | None:
    """The CSV's header and its cells, or None when the outputs are not one short row of numbers per input.
    A classifier (its class names known) gets `predicted` and `prob_<class>` (or `score_<class>` when the rows
    are not probabilities)."""
    if not isinstance(outputs, Tensor) or outputs.dim() not in (1, 2) or not outputs.is_floating_point():
        return None
    rows = outputs.float().reshape(len(outputs), -1)
    if rows.shape[1] > SHORT and not classes:
        return None
    cells = [[f"{v:.6g}" for v in row] for row in rows.tolist()]
    if classes and rows.shape[1] == len(classes):
        kind = "prob" if _probabilities(rows) else "score"
        best = rows.argmax(1).tolist()
        return ["predicted", *(f"{kind}_{c}" for c in classes)], [[classes[b], *c] for b, c in zip(best, cells)]
    if outputs.dim() == 1:
        return ["output"], cells
    return [f"output_{i}" for i in range(rows.shape[1])], cells


class PredictionsWriter(L.Callback):
    """Collects what `predict_step` returns for batches of (inputs, indices) and writes `folder`/predictions.pt
    (`files` and `outputs`: the outputs of every input stacked in input order, the structure predict_step returns)
    and, where each output is a short row of numbers, predictions.csv (`file`, then the numbers)."""

    def __init__(self, folder: Path, names: Sequence[str], classes: Sequence[str] | None = None) -> None:
        self.folder, self.names = folder, list(names)
        self.classes = list(classes) if classes else None
        self.indices: list[Tensor] = []
        self.outputs: list[Any] = []

    def on_predict_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self.indices.append(batch[1].detach().cpu())
        self.outputs.append(tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, outputs))

    def _gathered(self, trainer: L.Trainer) -> tuple[list[Tensor], list[Any]]:
        if trainer.world_size < 2:
            return self.indices, self.outputs
        import torch.distributed as dist

        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, (self.indices, self.outputs))  # shards differ in length: objects
        return [i for p in parts for i in p[0]], [o for p in parts for o in p[1]]

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        indices, outputs = self._gathered(trainer)
        if not trainer.is_global_zero:
            return
        merged = _in_input_order(torch.cat(indices), outputs, len(self.names))
        fix = "free space on that disk, or set paths.log_dir"
        write_file(self.folder / TENSORS, lambda part: torch.save({"files": self.names, "outputs": merged}, part), fix)
        table = columns(merged, self.classes)
        if table is None:
            log.info(
                "%s holds what predict_step returned for each input; no %s: its outputs are not one short row "
                "of numbers per input",
                TENSORS,
                TABLE,
            )
            return
        header, rows = table

        def write_table(part: Path) -> None:
            with open(part, "w", newline="") as f:
                writer = csv.writer(f)  # cells as they are: a file name starting with "=" is not escaped
                writer.writerow(["file", *header])
                writer.writerows([name, *row] for name, row in zip(self.names, rows))

        write_file(self.folder / TABLE, write_table, fix)


def _in_input_order(indices: Tensor, outputs: list[Any], count: int) -> Any:
    """The batches' outputs as one structure of tensors, row i for input i (a repeated index repeats an input)."""
    flat = [tree_flatten(out) for out in outputs]
    if not flat or any(not isinstance(leaf, Tensor) or not leaf.dim() for leaf in flat[0][0]):
        raise RuntimeError("predict_step must return a tensor (or a dict, tuple or list of tensors) per batch")
    leaves = [torch.cat(parts) for parts in zip(*(leaves for leaves, _ in flat))]
    first: dict[int, int] = {}
    for position, index in enumerate(indices.tolist()):
        first.setdefault(index, position)
    if sorted(first) != list(range(count)):
        raise RuntimeError(f"predictions for {len(first)} of {count} inputs")
    order = torch.tensor([first[i] for i in range(count)])
    return tree_unflatten([leaf[order] for leaf in leaves], flat[0][1])
