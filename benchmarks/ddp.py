"""`make bench` figure 5: data parallelism on CPU, ddp with 2 processes (1 torch thread each) against 1 process,
training samples per second on a compute-bound net: the default LeNet at batch 64 per process, whose steps are
convolutions, not Python. Both are real `train.py` runs (`trainer=ddp trainer.accelerator=cpu` for two), timed
from inside (benchmarks/epoch_timer.py) on the last of 2 epochs, so start-up and warm-up stay out.

Baselines, in the same interleaved rounds: 1 process on 1 thread (the target's: >= 1.6x) and 1 process on
2 threads (the other way to use both cores). Writes benchmarks/results/ddp.json and ddp.png.
"""

import argparse
from typing import Any

from plotting import bars
from timing import RESULTS, cores, interleaved, summary, write_results
from train_process import timed_epochs

COMMON = ["model=lenet", "trainer.max_epochs=2", "test=false", "trainer.accelerator=cpu"]
CONFIGS: dict[str, tuple[list[str], int]] = {
    "1 process, 1 thread": (COMMON, 1),
    "1 process, 2 threads": (COMMON, 2),
    "ddp: 2 processes, 1 thread each": ([*COMMON, "trainer=ddp", "trainer.devices=2"], 1),
}
TARGET = 1.6


def samples_per_s(overrides: list[str], threads: int) -> float:
    last = timed_epochs(overrides, threads)[-1]
    return last["samples"] / last["train_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if cores() < 2:
        raise SystemExit("ddp.py needs 2 cores: one per process")
    runs = interleaved(
        {name: lambda o=overrides, t=threads: samples_per_s(o, t) for name, (overrides, threads) in CONFIGS.items()},
        repeats=args.repeats,
    )
    rows: dict[str, Any] = {name: summary(rates) for name, rates in runs.items()}
    base = rows["1 process, 1 thread"]["median"]
    for name, row in rows.items():
        row["speedup_vs_1_process_1_thread"] = row["median"] / base
        print(f"{name:34s} {row['median']:8.0f} samples/s  x{row['speedup_vs_1_process_1_thread']:.2f}")
    path = write_results(
        "ddp",
        {
            "overrides": {name: o for name, (o, _) in CONFIGS.items()},
            "threads": {name: t for name, (_, t) in CONFIGS.items()},
            "repeats": args.repeats,
            "rows": rows,
            "target_speedup": TARGET,
        },
    )
    bars(
        rows,
        RESULTS / "ddp.png",
        "LeNet, batch 64 per process, training samples/s (last of 2 epochs)",
        "samples/s (median, min-max)",
        target=(f"target: {TARGET}x 1 process, 1 thread", TARGET * base),
    )
    print(f"wrote {path} and {RESULTS / 'ddp.png'}")


if __name__ == "__main__":
    main()
