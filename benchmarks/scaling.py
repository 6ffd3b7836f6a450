"""`make bench` figure 6: how epoch time grows with the data (the default digits' training split repeated 1x, 4x,
16x: benchmarks/repeated_digits.py) and with devices (1 process, or ddp on 2 CPU processes of 1 thread each),
for the 784-64-128-64 MLP at batch 64 per process. Real `train.py` runs, timed from inside
(benchmarks/epoch_timer.py) on the last of 2 epochs. Expected: near-linear in data, about half with 2 processes.
Writes benchmarks/results/scaling.json and scaling.png.
"""

import argparse
from typing import Any

from plotting import pyplot
from timing import RESULTS, interleaved, summary, write_results
from train_process import timed_epochs

SIZES = (1, 4, 16)
DEVICES = (1, 2)
COMMON = [
    "model=mlp",
    "model.net.hidden=[64,128,64]",
    "data._target_=repeated_digits.RepeatedDigits",
    "trainer.max_epochs=2",
    "trainer.accelerator=cpu",
    "test=false",
]


def overrides(size: int, devices: int) -> list[str]:
    ddp = ["trainer=ddp", "trainer.devices=2"] if devices == 2 else []
    return [*COMMON, f"+data.repeat={size}", *ddp]


def epoch_s(size: int, devices: int) -> dict[str, float]:
    last = timed_epochs(overrides(size, devices), threads=1)[-1]
    return {"train_s": last["train_s"], "epoch_s": last["epoch_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES), choices=DEVICES)
    args = parser.parse_args()
    grid = {(size, devices): f"{size}x data, {devices} process(es)" for devices in args.devices for size in args.sizes}
    runs = interleaved({name: lambda s=s, d=d: epoch_s(s, d) for (s, d), name in grid.items()}, repeats=args.repeats)
    rows: dict[str, Any] = {}
    for (size, devices), name in grid.items():
        rows[name] = {
            "size": size,
            "devices": devices,
            "train_s": summary([r["train_s"] for r in runs[name]]),
            "epoch_s": summary([r["epoch_s"] for r in runs[name]]),
        }
        one = rows.get(f"{args.sizes[0]}x data, {devices} process(es)")
        if one is not None:  # how far from linear in data: 1.0 is exactly proportional
            rows[name]["vs_linear"] = rows[name]["train_s"]["median"] / (
                one["train_s"]["median"] * size / args.sizes[0]
            )
        train_s, whole_s = rows[name]["train_s"]["median"], rows[name]["epoch_s"]["median"]
        print(f"{name:28s} train {train_s:7.3f} s   epoch {whole_s:7.3f} s")
    path = write_results(
        "scaling", {"overrides": COMMON, "repeats": args.repeats, "threads_per_process": 1, "rows": rows}
    )
    plot(rows, args.sizes, args.devices)
    print(f"wrote {path} and {RESULTS / 'scaling.png'}")


def plot(rows: dict[str, Any], sizes: list[int], devices: list[int]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for d in devices:
        found = [rows[f"{s}x data, {d} process(es)"] for s in sizes]
        for ax, key in zip(axes, ("train_s", "epoch_s")):
            med = [r[key]["median"] for r in found]
            err = [[m - r[key]["min"] for m, r in zip(med, found)], [r[key]["max"] - m for m, r in zip(med, found)]]
            ax.errorbar(sizes, med, yerr=err, marker="o", capsize=4, label=f"{d} process(es)")
            if d == devices[0]:
                ax.plot(sizes, [med[0] * s / sizes[0] for s in sizes], ":", color="#888888", label="linear from 1x")
    for ax, what in zip(axes, ("training part of an epoch", "whole epoch (validation, checkpoint included)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(sizes, [f"{s}x" for s in sizes])
        ax.set_xlabel("training data (3,500 digits repeated)")
        ax.set_ylabel("seconds (median, min-max)")
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Epoch time against data size and devices: MLP 784-64-128-64, batch 64 per process, 1 thread each")
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
