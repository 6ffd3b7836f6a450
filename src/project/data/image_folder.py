"""Your own images: a folder with one subfolder per class (torchvision's ImageFolder layout).

    root/cat/001.jpg, root/dog/002.png, ...                  split into train/val/test once, by `split_seed`
    root/train/cat/..., root/val/cat/..., root/test/cat/...  the split as given (a missing val/ or test/ is
                                                             carved out of train/ by `split_seed`)

Images are decoded per sample in `num_workers` worker processes, converted to grey or RGB (`channels`), resized
to `image_size` and, for training only, randomly shifted (`crop_padding`) and rotated/translated/scaled (affine).
The order of each epoch and the shards of ddp ranks come from TensorDataModule: one seeded permutation per
epoch, cut into the ranks' shards, so one device and N see the same global batches.
"""

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from engine import (
    InputSpec,
    ResumableLoader,
    ResumableSampler,
    TensorDataModule,
    UserError,
    load_image,
    model_input,
    split,
)

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def class_folders(root: Path) -> list[str]:
    """Class names: the subfolders, sorted (ImageFolder's order, so label i is the i-th name)."""
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))


def _check_layout(root: Path, classes: list[str]) -> None:
    """Each class folder holds image files at its top level, looked at without walking: a root that is not a folder
    of class folders (`data.root=/`, from a config or a checkpoint) is refused before anything walks it."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for name in classes:
        with os.scandir(root / name) as entries:
            if not any(e.name.lower().endswith(IMG_EXTENSIONS) and e.is_file() for e in entries):
                raise UserError(
                    f"data.root={root}: its subfolder {name}/ holds no image files; data.root must be a folder of "
                    "class folders of images (root/<class>/<image>)"
                )


def _size(image_size: int | Sequence[int]) -> tuple[int, int]:
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"image_size={image_size}: one side, or [height, width], of at least 1 pixel")
    return size[0], size[1]


def _per_channel(values: Sequence[float], channels: int, name: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if len(values) == 1:
        return values * channels
    if len(values) != channels:
        raise ValueError(f"{name}={list(values)}: one value, or one per channel ({channels})")
    return values


class _Transformed(Dataset):
    """A subset of an ImageFolder, each sample through `transform`: train and val/test differ only here. A file
    that is not a readable image (truncated, another format) stops the run naming it, or with `skip_bad` is
    skipped (logged once per file and process; its batch is one sample shorter)."""

    def __init__(self, subset: Subset, transform: Any, skip_bad: bool = False) -> None:
        self.subset, self.transform, self.skip_bad = subset, transform, skip_bad
        self.skipped: set[str] = set()

    def __len__(self) -> int:
        return len(self.subset)

    def __getitem__(self, index: int) -> tuple[Tensor, int] | None:
        folder: Any = self.subset.dataset
        path = folder.samples[self.subset.indices[index]][0]
        try:
            image, label = self.subset[index]
        except (OSError, ValueError, SyntaxError) as e:  # what PIL raises for a file it cannot decode
            if not self.skip_bad:
                raise UserError(
                    f"{path}: not a readable image ({type(e).__name__}: {e}); remove or replace it, or skip such "
                    "files with data.skip_bad_images=true"
                ) from None
            if path not in self.skipped:
                self.skipped.add(path)
                log.warning("Skipped %s: not a readable image (%s)", path, e)
            return None
        return self.transform(image), label


def _without_skipped(batch: list[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate([sample for sample in batch if sample is not None])


class ImageFolderDataModule(TensorDataModule):
    """Class subfolders of images; see the module docstring. `mean`/`std`: of pixels in [0, 1], one value or
    one per channel. `num_classes` (the model's, when given) must match the number of class folders."""

    def __init__(
        self,
        root: str,
        image_size: int | Sequence[int] = 28,
        channels: int = 1,
        mean: Sequence[float] = (0.5,),
        std: Sequence[float] = (0.5,),
        num_classes: int | None = None,
        batch_size: int = 64,
        num_workers: int = 2,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        shuffle: bool = True,
        augment: bool = True,
        skip_bad_images: bool = False,
        crop_padding: int = 2,
        degrees: float = 10.0,
        translate: float = 0.1,
        scale: Sequence[float] = (0.9, 1.1),
    ) -> None:
        super().__init__(batch_size=batch_size, on_device=False, shuffle=shuffle)
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"root={root}: no such folder; point data.root at a folder of class subfolders")
        self.spec = self.input_spec(
            {"image_size": image_size, "channels": channels, "mean": list(mean), "std": list(std)}
        )
        self.given = [name for name in SPLITS if (self.root / name).is_dir()] if (self.root / "train").is_dir() else []
        self.classes = class_folders(self.root / "train" if self.given else self.root)
        self.num_classes = len(self.classes)
        if len(self.classes) < 2:
            raise ValueError(f"root={root}: {len(self.classes)} class subfolders; a classifier needs at least 2")
        _check_layout(self.root / "train" if self.given else self.root, self.classes)
        if num_classes is not None and num_classes != len(self.classes):
            raise ValueError(
                f"root={root} has {len(self.classes)} classes ({', '.join(self.classes[:5])}"
                f"{', ...' if len(self.classes) > 5 else ''}) but the model has {num_classes}: "
                f"set model.num_classes={len(self.classes)}"
            )
        if num_workers < 0 or not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1:
            raise ValueError(f"num_workers={num_workers} >= 0, fractions in [0, 1): {val_fraction}, {test_fraction}")
        self.num_workers, self.split_seed, self.skip_bad_images = num_workers, split_seed, skip_bad_images
        self.fractions = {"val": val_fraction, "test": test_fraction}
        self.augmentations = (
            [v2.RandomCrop(_size(image_size), padding=crop_padding)] if augment and crop_padding > 0 else []
        )
        if augment and (degrees or translate or tuple(scale) != (1, 1)):
            self.augmentations.append(v2.RandomAffine(degrees, translate=(translate, translate), scale=tuple(scale)))
        self.datasets: dict[str, Dataset] = {}

    @classmethod
    def input_spec(cls, config: dict) -> InputSpec:
        """What a model trained on this data takes (predict.py, export.py read it from a checkpoint's config)."""
        channels = int(config.get("channels", 1))
        height, width = _size(config.get("image_size", 28))
        mean = _per_channel(config.get("mean", (0.5,)), channels, "mean")
        std = _per_channel(config.get("std", (0.5,)), channels, "std")
        return InputSpec(channels=channels, height=height, width=width, mean=mean, std=std)

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: the class names, so predictions.csv and exports can name classes."""
        return {"classes": list(self.classes)}

    def _folder(self, path: Path) -> ImageFolder:
        try:
            folder = ImageFolder(str(path), loader=functools.partial(load_image, channels=self.spec.channels))
        except FileNotFoundError as e:  # a class folder without images
            raise UserError(f"{path}: {e}; remove the empty class folders or add images to them") from None
        if folder.classes != self.classes:
            raise ValueError(f"{path}: classes {folder.classes} differ from train/'s {self.classes}")
        return folder

    def _indices(self) -> dict[str, Any]:
        """(ImageFolder, indices) per split: given subfolders as they are, the rest carved out by split_seed."""
        base = self._folder(self.root / "train" if self.given else self.root)
        carved = [name for name in ("val", "test") if name not in self.given]
        n = len(base)
        sizes = [round(n * self.fractions[name]) for name in carved]
        if n - sum(sizes) < 1 or any(size < 1 for size in sizes):
            raise ValueError(f"root={self.root}: {n} images cannot be split into train and {', '.join(carved)}")
        parts = split(n, [n - sum(sizes), *sizes], self.split_seed)
        found = {"train": (base, parts[0].tolist())}
        found.update({name: (base, part.tolist()) for name, part in zip(carved, parts[1:])})
        for name in self.given[1:]:
            folder = self._folder(self.root / name)
            found[name] = (folder, list(range(len(folder))))
        return found

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        to_tensor = v2.PILToTensor()
        train = v2.Compose([to_tensor, model_input(self.spec, self.augmentations)])
        plain = v2.Compose([to_tensor, model_input(self.spec)])
        for name, (folder, indices) in self._indices().items():
            transform = train if name == "train" else plain
            self.datasets[name] = _Transformed(Subset(folder, indices), transform, self.skip_bad_images)
        sizes = ", ".join(f"{name} {len(ds)}" for name, ds in self.datasets.items())  # type: ignore[arg-type]
        log.info("%s: %d classes; %s images", self.root, len(self.classes), sizes)

    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        dataset = self.datasets[name]
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        options: dict[str, Any] = dict(
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,  # decoding workers live across epochs
            collate_fn=_without_skipped if self.skip_bad_images else None,
            pin_memory=on_gpu,
        )
        if name != "train":  # shared among processes by engine.callbacks.eval_shards, each image once
            return DataLoader(dataset, **options)
        seed = self._order_seed() if shuffle else 0
        sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, **self._shard())
        return ResumableLoader(dataset, sampler=sampler, **options)  # training continues mid-epoch on resume
