"""What predict.py reads: a folder of images, one image, or an IDX file (MNIST's format), as model input.

Every file is checked before any prediction starts, so a bad one stops the command with one line naming it. Images
are converted as the training data was (engine.data.images); with `resize=false` another size is refused instead."""

import gzip
import math
import struct
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from PIL import UnidentifiedImageError
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from engine.data.images import as_channels, load_image, model_input, open_image
from engine.data.spec import InputSpec
from engine.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".ppm", ".tif", ".tiff", ".webp")
_IDX_UBYTE = 0x08  # the IDX type code of unsigned bytes: the only one images come in


def _idx_bytes(path: Path) -> bytes | None:
    """The (decompressed) bytes of an IDX file, or None if `path` is not one: IDX starts with two zero bytes."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip, as MNIST is distributed
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise UserError(f"input={path}: a gzip file that cannot be read ({e})") from e
    return data if len(data) >= 4 and data[:2] == b"\x00\x00" else None


def read_idx(path: Path, data: bytes) -> Tensor:
    """uint8 images (N, H, W) of an IDX file of images, e.g. t10k-images-idx3-ubyte."""
    kind, ndim = data[2], data[3]
    if kind != _IDX_UBYTE:
        raise UserError(f"input={path}: an IDX file of type 0x{kind:02x}; images are IDX files of unsigned bytes")
    if ndim != 3:
        what = "labels, not images" if ndim == 1 else f"{ndim}-dimensional data, not images (N x H x W)"
        raise UserError(f"input={path}: an IDX file of {what}; pass an images file such as t10k-images-idx3-ubyte")
    header = 4 + 4 * ndim
    dims = struct.unpack(">3I", data[4:header])
    if len(data) - header != math.prod(dims):
        raise UserError(
            f"input={path}: its header promises {dims[0]} images of {dims[1]}x{dims[2]} but it holds "
            f"{len(data) - header} bytes of pixels; the file is cut off or not IDX"
        )
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(dims)


def _check_image(path: Path, shown: str, spec: InputSpec, resize: bool) -> None:
    try:
        with open_image(path) as image:
            size = image.size
            image.verify()  # reads the whole file: a cut-off or damaged image fails now, not mid-run
        load_image(path, spec.channels)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UserError(f"input: {shown} is not a readable image ({' '.join(str(e).split())})") from e
    if not resize and size != (spec.width, spec.height):
        raise UserError(
            f"input: {shown} is {size[0]}x{size[1]} pixels, the model takes {spec.width}x{spec.height} "
            "(resize=true converts it)"
        )


class PredictInputs(Dataset):
    """{"input": model input, "name": where it came from} per image (predictions.csv's `name` column)."""

    def __init__(self, path: str, spec: InputSpec, resize: bool = True) -> None:
        source = Path(path).expanduser()
        self.transform = model_input(spec)
        self.spec = spec
        self.files: list[Path] = []
        self.pixels: Tensor | None = None  # an IDX file's images, (N, 1, H, W) uint8
        if not source.exists():
            raise UserError(f"input={path}: no such file or folder; pass a folder of images, an image or an IDX file")
        if source.is_dir():
            self.files = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not self.files:
                raise UserError(f"input={path}: no image files ({', '.join(IMAGE_SUFFIXES)}) in this folder")
            self.names = [p.relative_to(source).as_posix() for p in self.files]
        else:
            data = _idx_bytes(source)
            if data is not None:
                images = read_idx(source, data)
                if len(images) == 0:
                    raise UserError(f"input={path}: an IDX file without images")
                if not resize and tuple(images.shape[1:]) != (spec.height, spec.width):
                    raise UserError(
                        f"input={path}: its images are {images.shape[2]}x{images.shape[1]} pixels, the model takes "
                        f"{spec.width}x{spec.height} (resize=true converts them)"
                    )
                self.pixels = images.unsqueeze(1)
                self.names = [f"{source.name}[{i}]" for i in range(len(images))]
            else:
                self.files, self.names = [source], [str(path)]
        for file, name in zip(self.files, self.names):
            _check_image(file, name, spec, resize)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.pixels is not None:
            pixels = self.pixels[index]
        else:
            from torchvision.transforms.v2.functional import pil_to_tensor

            pixels = pil_to_tensor(load_image(self.files[index], self.spec.channels))
        return {"input": self.transform(as_channels(pixels, self.spec.channels)), "name": self.names[index]}


class ImageInputs(L.LightningDataModule):
    """predict.py's `input=`: images as a model of images takes them, in batches, in order."""

    def __init__(self, inputs: PredictInputs, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.inputs, self.batch_size, self.num_workers = inputs, batch_size, num_workers

    def predict_dataloader(self) -> DataLoader:
        pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(self.inputs, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=pin)
