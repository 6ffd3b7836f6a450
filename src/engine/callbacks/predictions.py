"""What `predict_step` returns, one entry per input in input order, written once by rank 0 whatever the strategy.
Under several processes the predict loader is sharded padded (engine.callbacks.eval_shards: as many batches on every
rank), repeating a few inputs: every rank's (loader, index) pairs are gathered on rank 0, which drops the repeats and
puts the outputs in order.
"""

import csv
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from engine.runs.atomic_io import write_file

log = logging.getLogger(__name__)

TENSORS = "predictions.pt"
TABLE = "predictions.csv"
PARQUET = "predictions.parquet"
SHORT = 32  # outputs of at most this many numbers per input get a table row; longer ones only the tensor file


def _probabilities(rows: Tensor) -> bool:
    return bool((rows >= 0).all() and torch.allclose(rows.sum(1), torch.ones(len(rows)), atol=1e-3))


def columns(outputs: Any, classes: Sequence[str] | None) -> tuple[list[str], list[list[Any]]] | None:
    """The table's header and cells, or None when the outputs are not one short row per input (numbers or strings);
    a classifier with known class names gets `predicted` and `prob_<class>` (`score_<class>` if not probabilities)."""
    if isinstance(outputs, list) and all(isinstance(o, str) for o in outputs):
        return ["output"], [[o] for o in outputs]
    if not isinstance(outputs, Tensor) or outputs.dim() not in (1, 2) or outputs.dtype == torch.bool:
        return None
    rows = outputs.float().reshape(len(outputs), -1)
    if rows.shape[1] > SHORT and not classes:
        return None
    cells: list[list[Any]] = rows.tolist()
    if classes and rows.shape[1] == len(classes) and outputs.is_floating_point():
        kind = "prob" if _probabilities(rows) else "score"
        best = rows.argmax(1).tolist()
        return ["predicted", *(f"{kind}_{c}" for c in classes)], [[classes[b], *c] for b, c in zip(best, cells)]
    if outputs.dim() == 1:
        return ["output"], cells
    return [f"output_{i}" for i in range(rows.shape[1])], cells


class PredictionsWriter(BasePredictionWriter):
    """Collects every batch's outputs, indices and names; writes `folder`/predictions.pt (and the tables) at the
    end. `classes`: a classifier's class names, for the table's columns."""

    def __init__(self, folder: Path, classes: Sequence[str] | None = None) -> None:
        super().__init__(write_interval="batch")
        self.folder = folder
        self.classes = list(classes) if classes else None
        self.indices: list[list[tuple[int, int]]] = []  # (predict loader, sample index): each loader counts from 0
        self.names: list[list[str] | None] = []
        self.outputs: list[Any] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_indices is None or not len(batch_indices):
            raise RuntimeError("predictions need a DataLoader with a batch sampler: Lightning gave no batch indices")
        self.indices.append([(dataloader_idx, int(i)) for i in batch_indices])
        names = batch.get("name") if isinstance(batch, dict) else None
        self.names.append([str(n) for n in names] if isinstance(names, (list, tuple)) else None)
        self.outputs.append(tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, prediction))

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        parts = [(self.indices, self.names, self.outputs)]
        if trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, parts[0])  # shards differ in length: objects
            parts = gathered
        if not trainer.is_global_zero:
            return
        indices = [i for p in parts for batch in p[0] for i in batch]
        names: list[str | None] = []
        for part in parts:
            for batch_names, batch_indices in zip(part[1], part[0]):
                names += batch_names if batch_names is not None else [None] * len(batch_indices)
        outputs, order = _in_input_order(indices, [o for p in parts for o in p[2]])
        named = [names[i] for i in order]
        shown = [str(n) for n in named] if all(n is not None for n in named) else [str(i) for i in range(len(order))]
        self._write(shown, outputs)

    def _write(self, names: list[str], outputs: Any) -> None:
        fix = "free space on that disk, or set paths.log_dir"
        write_file(self.folder / TENSORS, lambda part: torch.save({"names": names, "outputs": outputs}, part), fix)
        table = columns(outputs, self.classes)
        if table is None:
            log.info("%s holds what predict_step returned for each input (not one short row each: no table)", TENSORS)
            return
        header, rows = table

        def write_csv(part: Path) -> None:
            with open(part, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
                writer = csv.writer(f)  # cells as they are: a name starting with "=" is not escaped
                writer.writerow(["name", *header])
                writer.writerows([name, *(_cell(c) for c in row)] for name, row in zip(names, rows))

        write_file(self.folder / TABLE, write_csv, fix)
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            return
        columns_ = {"name": names, **{h: [row[i] for row in rows] for i, h in enumerate(header)}}
        table_ = pa.table({k: [_text(v) for v in vs] if k == "name" else vs for k, vs in columns_.items()})
        write_file(self.folder / PARQUET, lambda part: pq.write_table(table_, part), fix)


def _cell(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def _text(name: str) -> str:
    """A name as Parquet's UTF-8 strings can hold it: a file name the file system gave in another encoding keeps
    its bytes escaped."""
    return name.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")


def _in_input_order(indices: list[tuple[int, int]], outputs: list[Any]) -> tuple[Any, list[int]]:
    """The batches' outputs as one structure, row i for the i-th distinct (loader, input index) in that order (a
    repeated one, ddp's padding, counts once), and the positions kept."""
    first: dict[tuple[int, int], int] = {}
    for position, index in enumerate(indices):
        first.setdefault(index, position)
    order = [first[i] for i in sorted(first)]
    if outputs and all(isinstance(o, (list, tuple)) and all(isinstance(s, str) for s in o) for o in outputs):
        flat = [s for o in outputs for s in o]
        return [flat[p] for p in order], order
    leaves = [tree_flatten(out) for out in outputs]
    if not leaves or any(not isinstance(leaf, Tensor) or not leaf.dim() for leaf in leaves[0][0]):
        raise RuntimeError(
            "predict_step must return, per batch, a tensor (or a dict, tuple or list of tensors) or a list of strings"
        )
    joined = [torch.cat(parts) for parts in zip(*(flat for flat, _ in leaves))]
    take = torch.tensor(order)
    return tree_unflatten([leaf[take] for leaf in joined], leaves[0][1]), order
