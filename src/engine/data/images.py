"""Images to model input: one pipeline for training on an image folder, predicting, and checking an export.

Grey or RGB as the model takes it, resized, scaled to [0, 1] and standardized with the training data's statistics:
for 28x28 grey digits exactly `engine.data.tensors.normalize`."""

import os
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms import v2

from engine.data.spec import InputSpec

# Modes PIL converts to grey or RGB without a choice to make; 16-bit and float images have no one 0-255 scale.
CONVERTIBLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")


def pil_mode(channels: int) -> str:
    return "L" if channels == 1 else "RGB"


# The largest image read, from its header before a pixel is decoded. Set PROJECT_MAX_IMAGE_PIXELS to read larger
# ones: it is PIL's own limit too (Image.MAX_IMAGE_PIXELS), so there is one.
MAX_IMAGE_PIXELS = int(os.environ.get("PROJECT_MAX_IMAGE_PIXELS", 8192 * 8192))
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS


@contextmanager
def open_image(path: str | Path) -> Iterator[Image.Image]:
    """Image.open, refusing an image of more than MAX_IMAGE_PIXELS pixels from its header (PIL's decompression-bomb
    check at our limit, its warning an error): a ValueError naming both, not a traceback nor gigabytes decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            pixels = re.search(r"\((\d+) pixels\)", str(e))
            raise ValueError(
                f"{pixels.group(1) if pixels else 'too many'} pixels: more than PROJECT_MAX_IMAGE_PIXELS="
                f"{MAX_IMAGE_PIXELS} (set it higher to read it)"
            ) from e
    with image:
        yield image


def load_image(path: str | Path, channels: int) -> Image.Image:
    """An image file as grey or RGB. Transparent pixels become black: MNIST-like digits are light on black."""
    with open_image(path) as image:
        if image.mode not in CONVERTIBLE_MODES:
            raise ValueError(f"{image.mode} images (16-bit or float pixels) have no 0-255 scale to convert from")
        if "A" in image.getbands() or "transparency" in image.info:
            image = image.convert("RGBA")
            background = Image.new("RGBA", image.size, (0, 0, 0, 255))
            image = Image.alpha_composite(background, image)
        return image.convert(pil_mode(channels))


def as_channels(pixels: Tensor, channels: int) -> Tensor:
    """uint8 (C, H, W) or (N, C, H, W) with C in (1, 3) to `channels` channels (grey as training made it)."""
    if pixels.shape[-3] == channels:
        return pixels
    if channels == 3:
        return pixels.expand(*pixels.shape[:-3], 3, *pixels.shape[-2:])
    return v2.functional.rgb_to_grayscale(pixels)


def model_input(spec: InputSpec, augment: Sequence[Any] = ()) -> v2.Compose:
    """uint8 pixels (C, H, W), C already `spec.channels`, to the float input of the model; `augment`
    (random transforms) runs on the resized uint8 image, before scaling."""
    return v2.Compose(
        [
            v2.Resize((spec.height, spec.width), antialias=True),  # returns the image as is when it fits
            *augment,
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(spec.mean), list(spec.std)),
        ]
    )
