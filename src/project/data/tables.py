"""Rows of numbers and a number to predict for each: scikit-learn's diabetes table (it ships with the package: no
download), or a CSV file of your own. The worked example of data that is not images: `data=diabetes`.

The features are standardized with the training rows' mean and std, kept in the checkpoint (state_dict), so that
predict.py scores the rows of another CSV exactly as training saw its rows: `python predict.py ckpt_path=...
data.predict_path=rows.csv` (a CSV with the same feature columns; the target column may be missing).
"""

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset


def read_csv(path: Path, target: str | None) -> tuple[list[str], Tensor, Tensor | None]:
    """(feature column names, features (N, F), target (N,) or None when the file has no `target` column)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: a header and at least one row expected")
    header, body = rows[0], rows[1:]
    columns = [c for c in header if c != target]
    try:
        values = torch.tensor([[float(cell) for cell in row] for row in body], dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"{path}: every cell must be a number ({e})") from e
    if target in header:
        i = header.index(target)
        return columns, torch.cat([values[:, :i], values[:, i + 1 :]], 1), values[:, i]
    return columns, values, None


def read_diabetes() -> tuple[list[str], Tensor, Tensor]:
    """442 patients: age, sex, body mass index, blood pressure and six blood serum measurements; the target is a
    measure of disease progression one year later (scikit-learn's copy of Efron et al., 2004)."""
    from sklearn.datasets import load_diabetes  # scikit-learn takes seconds to import: only here

    table = load_diabetes(scaled=False)
    return list(table.feature_names), torch.tensor(table.data, dtype=torch.float32), torch.tensor(table.target).float()


class Rows(Dataset):
    """Rows to score, each with its name (its line in the CSV): batches of {"input": (N, F), "name": [...]}."""

    def __init__(self, features: Tensor, names: list[str]) -> None:
        self.features, self.names = features, names

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input": self.features[i], "name": self.names[i]}


class TableDataModule(L.LightningDataModule):
    """`path`: a CSV with a header (None: scikit-learn's diabetes table); `target`: its column to predict. Split into
    train/val/test by `split_seed`, which stays the same whatever the run's seed."""

    def __init__(
        self,
        path: str | None = None,
        target: str = "target",
        batch_size: int = 32,
        val_size: int = 50,
        test_size: int = 50,
        split_seed: int = 0,
        shuffle: bool = True,
        predict_path: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or val_size < 1 or test_size < 1:
            raise ValueError(f"batch_size, val_size, test_size must be >= 1: {batch_size}, {val_size}, {test_size}")
        self.path, self.target, self.batch_size = path, target, batch_size
        self.val_size, self.test_size, self.split_seed, self.shuffle = val_size, test_size, split_seed, shuffle
        self.predict_path = predict_path
        self.mean: Tensor | None = None  # of the training rows' features: in every checkpoint (state_dict)
        self.std: Tensor | None = None
        self.columns: list[str] | None = None  # the training features' names, in their order: in checkpoints too

    def _table(self) -> tuple[list[str], Tensor, Tensor]:
        if self.path is None:
            return read_diabetes()
        columns, x, y = read_csv(Path(self.path).expanduser(), self.target)
        if y is None:
            raise ValueError(f"data.path={self.path}: no column {self.target!r} to predict (data.target)")
        return columns, x, y

    def setup(self, stage: str) -> None:
        if stage == "predict":
            return
        self.columns, x, y = self._table()
        if self.val_size + self.test_size >= len(y):
            raise ValueError(f"val_size + test_size must leave training rows out of {len(y)}")
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.split_seed))
        test, val, train = order.split([self.test_size, self.val_size, len(y) - self.val_size - self.test_size])
        if self.mean is None or self.std is None:  # a resumed or restored module keeps the statistics it had
            self.mean, self.std = x[train].mean(0), x[train].std(0).clamp(min=1e-8)
        x = (x - self.mean) / self.std
        self.splits = {name: TensorDataset(x[i], y[i]) for name, i in (("train", train), ("val", val), ("test", test))}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        """The rows of `predict_path`, standardized with the training statistics the checkpoint holds."""
        if self.predict_path is None:
            raise ValueError("nothing to predict on: pass data.predict_path=<a CSV of feature rows>")
        if self.mean is None or self.std is None:
            raise ValueError("no training statistics: predict with a checkpoint of a run that trained on this data")
        columns, x, _ = read_csv(Path(self.predict_path).expanduser(), self.target)
        if self.columns is not None:  # matched by name, in any order: by position, reordered columns scored wrong
            missing = [c for c in self.columns if c not in columns]
            if missing:
                raise ValueError(
                    f"data.predict_path={self.predict_path}: no column {missing[0]!r} of the training data"
                )
            x = x[:, [columns.index(c) for c in self.columns]]
        if x.shape[1] != len(self.mean):
            raise ValueError(
                f"data.predict_path={self.predict_path}: {x.shape[1]} feature columns, not {len(self.mean)}"
            )
        names = [f"row {i + 1}" for i in range(len(x))]
        return DataLoader(Rows((x - self.mean) / self.std, names), batch_size=self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "columns": self.columns}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.std, self.columns = state.get("mean"), state.get("std"), state.get("columns")
