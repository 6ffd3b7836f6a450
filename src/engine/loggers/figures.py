"""The images TensorBoardInsights writes, drawn with Pillow and numpy in a thread beside training, so what counts is
how long they hold the GIL: labels are rendered once (`_glyphs`), layout is numpy, only PNG encoding (GIL released)
is left. Inputs are never tensors: a torch op here starts a second OpenMP team (engine.callbacks.tensorboard).
"""

from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WHITE, RED, GREY, BLACK = (255, 255, 255), (255, 80, 80), (40, 40, 40), (0, 0, 0)
LIGHT, DARK = np.array([247, 251, 255]), np.array([8, 48, 107])  # matplotlib's "Blues" ends
SIZE = 11  # font size, pixels


@lru_cache(maxsize=1)
def _font() -> Any:
    return ImageFont.load_default(size=SIZE)


@lru_cache(maxsize=4096)
def _glyphs(text: str) -> Any:
    """`text` as a mask (an "L" image as tall as the font), rendered once: labels repeat from epoch to epoch."""
    font = _font()
    left, _, right, _ = font.getbbox(text)
    ascent, descent = font.getmetrics()
    mask = Image.new("L", (max(right - left, 1), ascent + descent))
    ImageDraw.Draw(mask).text((-left, 0), text, fill=255, font=font)
    return mask


def _write(image: Any, text: str, xy: tuple[int, int], fill: tuple[int, int, int], centre: bool = False) -> None:
    """`text` at `xy` (its top left corner, or its centre)."""
    mask = _glyphs(text)
    x, y = (xy[0] - mask.width // 2, xy[1] - mask.height // 2) if centre else xy
    image.paste(fill, (x, y, x + mask.width, y + mask.height), mask)


def image_summary(tag: str, image: np.ndarray) -> Any:
    """A TensorBoard image summary of an (H, W, 3) uint8 array, PNG-compressed once at the fast level: 3 ms for the
    sample grid against add_image's 15 ms (float round trip, resize, level 6), for a file 4% larger."""
    import io

    from tensorboard.compat.proto.summary_pb2 import Summary

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    height, width, channels = image.shape
    png = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=png)])


def sample_grid(tiles: np.ndarray, preds: list[int], targets: list[int], columns: int = 8, scale: int = 2) -> Any:
    """(H, W, 3) uint8: grey `tiles` (n, h, w) in a grid, each under its `predicted/true` label, the
    misclassified ones first and labelled in red."""
    order = sorted(range(len(preds)), key=lambda i: (preds[i] == targets[i], i))
    n, h, w = tiles.shape
    low, high = float(tiles.min()), float(tiles.max())
    pixels = ((tiles - low) / (high - low or 1.0) * 255).astype(np.uint8).repeat(scale, 1).repeat(scale, 2)
    cell_w, cell_h, label, title = w * scale + 6, h * scale + 16, 14, 20
    rows = (n + columns - 1) // columns
    canvas = np.empty((title + rows * cell_h + 4, columns * cell_w + 6, 3), np.uint8)
    canvas[:] = GREY
    places = [(6 + (k % columns) * cell_w, title + (k // columns) * cell_h) for k in range(len(order))]
    for (x, y), i in zip(places, order):
        canvas[y + label : y + label + h * scale, x : x + w * scale] = pixels[i, :, :, None]
    image = Image.fromarray(canvas)
    _write(image, "predicted/true, misclassified first", (6, 4), WHITE)
    for (x, y), i in zip(places, order):
        colour = WHITE if preds[i] == targets[i] else RED
        _write(image, f"{preds[i]}/{targets[i]}", (x + w * scale // 2, y + label // 2), colour, centre=True)
    return np.asarray(image)


def confusion_image(counts: np.ndarray, cell: int = 30) -> Any:
    """(H, W, 3) uint8: counts of true class (rows) against predicted class (columns), darker for more."""
    n = counts.shape[0]
    left, top = 34, 38
    canvas = np.empty((top + n * cell + 8, left + n * cell + 8, 3), np.uint8)
    canvas[:] = WHITE
    shade = counts / max(int(counts.max()), 1)
    colours = (LIGHT + (DARK - LIGHT) * shade[:, :, None]).astype(np.uint8)  # as int() truncated, per cell
    canvas[top : top + n * cell, left : left + n * cell] = colours.repeat(cell, 0).repeat(cell, 1)
    image = Image.fromarray(canvas)
    _write(image, "rows: true class, columns: predicted", (left, 4), BLACK)
    for j in range(n):
        _write(image, str(j), (left + j * cell + cell // 2, top - 8), BLACK, centre=True)
        _write(image, str(j), (left - 10, top + j * cell + cell // 2), BLACK, centre=True)
    for t, p in zip(*np.nonzero(counts)):
        ink = WHITE if shade[t, p] > 0.5 else BLACK
        centre = (left + p * cell + cell // 2, top + t * cell + cell // 2)
        _write(image, str(int(counts[t, p])), centre, ink, centre=True)
    return np.asarray(image)
