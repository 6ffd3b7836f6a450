"""`make bench`: what an epoch's two TensorBoard images cost the training thread.

engine.callbacks.tensorboard draws the sample grid and the confusion matrix in a thread of its own and writes them
as events; what the training thread pays is the time that thread holds the GIL. Measured as the slowdown of a
loop of small matrix products (about an MLP step's work) while a thread draws, encodes and writes one epoch's pair
of images at a time, as the callback does: with the checksums this project computes in C (google-crc32c) and with
TensorBoard's own pure-Python CRC-32C. Rounds interleaved. Writes benchmarks/results/figures.json.
"""

import argparse
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from timing import summary, write_results

from engine.loggers import figures
from engine.loggers.tensorboard import masked_crc32c


def images(rng: np.random.Generator) -> tuple[Any, Any]:
    """An epoch's inputs: 32 validation digits with predictions, and 10x10 counts that move from epoch to epoch."""
    tiles = rng.random((32, 28, 28), dtype=np.float32)
    preds, targets = rng.integers(0, 10, 32).tolist(), rng.integers(0, 10, 32).tolist()
    counts = rng.integers(0, 60, (10, 10))
    return (tiles, preds, targets), counts


def training_loop(steps: int) -> float:
    x, w = torch.randn(64, 784), torch.randn(784, 64)
    start = time.perf_counter()
    for _ in range(steps):
        (x @ w).relu_().sum()
    return time.perf_counter() - start


def with_images(steps: int, epochs: int, checksum: Any) -> float:
    """The loop's time while a thread draws and writes `epochs` pairs of images, one after another."""
    from tensorboard.summary.writer import record_writer
    from torch.utils.tensorboard import SummaryWriter

    record_writer.masked_crc32c = checksum
    writer = SummaryWriter(tempfile.mkdtemp(prefix="bench-figures-"))
    rng = np.random.default_rng(0)
    inputs = [images(rng) for _ in range(epochs)]

    def draw() -> None:
        for step, (grid, counts) in enumerate(inputs):
            events = writer._get_file_writer()
            events.add_summary(figures.image_summary("val/samples", figures.sample_grid(*grid)), step)
            events.add_summary(figures.image_summary("val/confusion_matrix", figures.confusion_image(counts)), step)
        writer.flush()

    thread = threading.Thread(target=draw)
    thread.start()
    took = training_loop(steps)
    thread.join()
    writer.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10, help="pairs of images drawn while the loop runs")
    parser.add_argument("--steps", type=int, default=3000, help="matrix products in the loop (longer than drawing)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    training_loop(args.steps)
    with_images(args.steps, 1, masked_crc32c)  # fonts, labels and imports paid once
    samples: dict[str, list[float]] = {"loop alone": [], "C checksums": [], "TensorBoard's checksums": []}
    for _ in range(args.repeats):
        samples["loop alone"].append(training_loop(args.steps))
        samples["C checksums"].append(with_images(args.steps, args.epochs, masked_crc32c))
        samples["TensorBoard's checksums"].append(with_images(args.steps, args.epochs, tensorboards))
    rows = {name: summary(values) for name, values in samples.items()}
    alone = rows["loop alone"]["median"]
    for name, row in rows.items():
        row["ms_per_epoch_of_images"] = (row["median"] - alone) / args.epochs * 1000
        print(f"{name:24s} loop {row['median'] * 1000:7.1f} ms, +{row['ms_per_epoch_of_images']:5.1f} ms per epoch")
    path = write_results("figures", {"epochs": args.epochs, "steps": args.steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
