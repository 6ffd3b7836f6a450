"""The images TensorBoardInsights writes, drawn with Pillow from numpy arrays: a few milliseconds each.

matplotlib took 0.15-0.4 s of CPU an epoch for the same two images, holding the GIL against the training
thread (on a 3 ms step that was most of an epoch). Inputs are numpy arrays and lists, never tensors: these run
in a thread of their own, and a torch op there would start a second OpenMP thread team (see
project.callbacks.tensorboard).
"""

from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WHITE, RED, GREY = (255, 255, 255), (255, 80, 80), (40, 40, 40)
LIGHT, DARK = np.array([247, 251, 255]), np.array([8, 48, 107])  # matplotlib's "Blues" ends


def _font(size: int) -> Any:
    return ImageFont.load_default(size=size)


def image_summary(tag: str, image: np.ndarray) -> Any:
    """A TensorBoard image summary of an (H, W, 3) uint8 array, PNG-compressed once at the fast level.
    SummaryWriter.add_image converts the array to float and back, resizes it (also at scale 1) and compresses at
    level 6: about 15 ms for the sample grid against 3 ms here (timed by hand on this project's 2-core machine),
    for a file 4% larger."""
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
    image = Image.new("RGB", (columns * cell_w + 6, title + rows * cell_h + 4), GREY)
    draw, font = ImageDraw.Draw(image), _font(11)
    draw.text((6, 4), "predicted/true, misclassified first", fill=WHITE, font=font)
    for k, i in enumerate(order):
        r, c = divmod(k, columns)
        x, y = 6 + c * cell_w, title + r * cell_h
        right = preds[i] == targets[i]
        draw.text((x + w * scale // 2, y + label // 2), f"{preds[i]}/{targets[i]}", font=font, anchor="mm",
                  fill=WHITE if right else RED)  # fmt: skip
        image.paste(Image.fromarray(pixels[i], "L").convert("RGB"), (x, y + label))
    return np.asarray(image)


def confusion_image(counts: np.ndarray, cell: int = 30) -> Any:
    """(H, W, 3) uint8: counts of true class (rows) against predicted class (columns), darker for more."""
    n = counts.shape[0]
    left, top = 34, 38
    image = Image.new("RGB", (left + n * cell + 8, top + n * cell + 8), WHITE)
    draw, font = ImageDraw.Draw(image), _font(11)
    draw.text((left, 4), "rows: true class, columns: predicted", fill=(0, 0, 0), font=font)
    shade = counts / max(int(counts.max()), 1)
    for j in range(n):
        draw.text((left + j * cell + cell // 2, top - 8), str(j), fill=(0, 0, 0), font=font, anchor="mm")
        draw.text((left - 10, top + j * cell + cell // 2), str(j), fill=(0, 0, 0), font=font, anchor="mm")
    for t in range(n):
        for p in range(n):
            colour = tuple(int(v) for v in LIGHT + (DARK - LIGHT) * shade[t, p])
            x, y = left + p * cell, top + t * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=colour)
            if counts[t, p]:
                ink = WHITE if shade[t, p] > 0.5 else (0, 0, 0)
                draw.text((x + cell // 2, y + cell // 2), str(int(counts[t, p])), fill=ink, font=font, anchor="mm")
    return np.asarray(image)
