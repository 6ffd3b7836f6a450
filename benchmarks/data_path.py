"""`make bench` figure 4: the template's data path against torchvision's `MNIST` + `DataLoader` with per-sample
ToTensor + Normalize, batches per second over the same 4,000 digits at batch 64, reshuffled each epoch.

The template's path is engine.data.tensors as a run uses it: one tensor per split, a ResumableSampler and one
indexing op per batch (`__getitems__`). The baseline is the textbook loader (and the lightning-hydra-template's):
a PIL image per sample, ToTensor, Normalize, default collate, num_workers=0. Both also as rank 0 of 2 (ddp's
sampler: half the epoch), where the target must still hold, and the template's path on one torch thread.
Target: >= 10x batches per second.
Writes benchmarks/results/data_path.json and data_path.png.
"""

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from digits_idx import write_digits_idx
from plotting import bars
from timing import RESULTS, interleaved, summary, write_results
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms
from torchvision.datasets import MNIST

from engine.data.resumable import ResumableLoader, ResumableSampler
from engine.data.tensors import TensorDataset, _batch_as_is, normalize
from project.data.digits import MNIST_MEAN, MNIST_STD

BATCH = 64
TARGET = 10.0


def template_loader(root: Path, replicas: int) -> DataLoader:
    """As TensorDataModule._loader builds it: tensors normalized once, a sampler, batches by one indexing op."""
    raw = MNIST(root, train=True)  # the same 4,000 digits, read once into tensors
    dataset = TensorDataset(normalize(raw.data, MNIST_MEAN, MNIST_STD), raw.targets)
    sampler = ResumableSampler(dataset, shuffle=True, seed=0, num_replicas=replicas, rank=0)
    return ResumableLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=_batch_as_is)


def torchvision_loader(root: Path, replicas: int) -> DataLoader:
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    dataset = MNIST(root, train=True, transform=tf)
    if replicas == 1:
        return DataLoader(dataset, batch_size=BATCH, shuffle=True)
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, num_replicas=replicas, rank=0))


def epoch(loader: DataLoader, state: dict[str, int]) -> float:
    """Batches per second over one epoch, as a training loop would draw them (set_epoch first, as Lightning does)."""
    state["epoch"] += 1
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(state["epoch"])
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += 1
    assert x.dtype == torch.float32 and x.shape[1:] == (1, 28, 28)
    return n / (time.perf_counter() - start)


def one_thread(measure: Callable[[], float]) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = write_digits_idx(Path(tempfile.mkdtemp(prefix="bench-data-path-")))
    configs: dict[str, Any] = {}
    for replicas in (1, 2):
        suffix = "" if replicas == 1 else ", rank 0 of 2"
        for name, make in (("template", template_loader), ("torchvision", torchvision_loader)):
            loader, state = make(root, replicas), {"epoch": 0}
            configs[f"{name}{suffix}"] = lambda loader=loader, state=state: epoch(loader, state)
    # Indexing a batch runs on torch's intra-op threads; on a busy machine a descheduled OpenMP thread stalls
    # every batch, which per-sample Python never notices. The same path with one thread shows how much.
    loader, state = template_loader(root, 1), {"epoch": 0}
    configs["template, 1 torch thread"] = lambda: one_thread(lambda: epoch(loader, state))
    rates = interleaved(configs, repeats=args.repeats, warmup=1)
    rows = {name: summary(r) for name, r in rates.items()}
    speedups = {
        "one process": rows["template"]["median"] / rows["torchvision"]["median"],
        "rank 0 of 2": rows["template, rank 0 of 2"]["median"] / rows["torchvision, rank 0 of 2"]["median"],
    }
    for name, row in rows.items():
        print(f"{name:28s} {row['median']:10.1f} batches/s")
    print("speed-up: " + ", ".join(f"{k} {v:.0f}x" for k, v in speedups.items()) + f" (target >= {TARGET:.0f}x)")
    path = write_results(
        "data_path",
        {
            "batch_size": BATCH,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "rows": rows,
            "speedup": speedups,
            "target_speedup": TARGET,
        },
    )
    bars(
        rows,
        RESULTS / "data_path.png",
        f"Data path: one epoch of 4,000 digits, batch {BATCH}",
        "batches/s (median, min-max)",
    )
    print(f"wrote {path} and {RESULTS / 'data_path.png'}")


if __name__ == "__main__":
    main()
