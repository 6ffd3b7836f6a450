"""`make bench-pipeline`: one device vs the plain model-parallel split vs the pipelined split, as the classic
model-parallel tutorial plots it, plus a sweep of the micro-batch count.

Each step is a forward and a backward of a whole batch through the template's own `pipe` code
(engine.strategies.pipe: stage threads, the clock schedule, the per-stage backward). On a CPU machine a
stage's "device" is its share of the cores: one intra-op thread per stage on 2 cores, against one device using
both cores. Configurations are timed in interleaved rounds (one step of each, repeated), so that drift on a
shared machine hits them all alike; every figure is the median with its min and max.

Writes benchmarks/results/pipeline.json and pipeline.png.
"""

import argparse
import copy
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.strategies import parallelize
from engine.strategies.pipe import PipeStrategy
from project.models.mlp import MLP
from project.models.resnet import ResNet18

RESULTS = Path(__file__).parent / "results"


def workloads() -> dict[str, dict[str, Any]]:
    """torchvision's ResNet-18 cut before layer3, as the model-parallel tutorial cuts ResNet-50 (conv1..layer2 |
    layer3..fc), batch 32 of 3x160x160; the template's ResNet-18 (small-image stem: stride 1, no max-pool) cut the
    same way, batch 64 of 3x32x32; and the template's MLP made wide enough that a step is compute, not Python:
    784 -> 4 x 1024 -> 10, batch 1024, cut by parameter count."""
    import torchvision

    return {
        "torchvision_resnet18": {
            "net": torchvision.models.resnet18(num_classes=10),
            "input": torch.randn(32, 3, 160, 160),
            "split_points": ["layer3"],
            "cut": "before layer3",
        },
        "resnet18": {
            "net": ResNet18(in_channels=3),
            "input": torch.randn(64, 3, 32, 32),
            "split_points": ["layer3"],
            "cut": "before layer3",
        },
        "mlp": {
            "net": MLP(hidden=(1024, 1024, 1024, 1024)),
            "input": torch.randn(1024, 1, 28, 28),
            "split_points": None,
            "cut": "by parameter count",
        },
    }


class Stepper:
    """One configuration: a forward and backward of the whole batch, timed."""

    def __init__(self, net: nn.Module, x: torch.Tensor, stages: int, micro_batches: int, split_points: Any) -> None:
        self.net, self.x = net, x
        self.targets = torch.randint(0, 10, (len(x),))
        self.strategy: PipeStrategy | None = None
        if stages > 1:
            strategy = PipeStrategy(micro_batches=micro_batches, split_points=split_points, threads_per_stage=1)
            strategy.plan = parallelize.plan_stages(net, stages, split_points)
            strategy.stage_devices = [torch.device("cpu")] * stages
            strategy.parallel_devices = strategy.stage_devices
            strategy._start_workers(net)
            self.strategy = strategy

    def step(self) -> float:
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(self.net(self.x), self.targets)
        loss.backward()
        if self.strategy is not None:
            self.strategy._backward_stages()
        self.net.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.strategy is not None:
            for worker in self.strategy.workers:
                worker.shutdown()
            self.net.__dict__.pop("forward", None)


def measure(name: str, spec: dict[str, Any], sweep: list[int], repeats: int, cores: int) -> dict[str, Any]:
    configs: dict[str, tuple[int, int]] = {"one device": (1, 1), "plain split (M=1)": (2, 1)}
    configs.update({f"pipelined M={m}": (2, m) for m in sweep})
    times: dict[str, list[float]] = {label: [] for label in configs}
    # a copy of the net per configuration, with its stage threads started once: only steps are timed
    steppers = {
        label: Stepper(copy.deepcopy(spec["net"]), spec["input"], stages, m, spec["split_points"])
        for label, (stages, m) in configs.items()
    }
    for round_ in range(repeats + 2):  # two warm-up rounds
        for label, stepper in steppers.items():
            # one device computes on every core; with stages the main thread only waits (one thread: its idle
            # OpenMP workers would otherwise spin on the cores the stage threads need)
            torch.set_num_threads(cores if stepper.strategy is None else 1)
            elapsed = stepper.step()
            if round_ >= 2:
                times[label].append(elapsed)
    for stepper in steppers.values():
        stepper.close()
    rows = {
        label: {
            "stages": configs[label][0],
            "micro_batches": configs[label][1],
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            "samples_per_s": len(spec["input"]) / statistics.median(t),
        }
        for label, t in times.items()
    }
    split = rows["plain split (M=1)"]["median_s"]
    for row in rows.values():
        row["speedup_vs_plain_split"] = split / row["median_s"]
        m, k = row["micro_batches"], row["stages"]
        # GPipe's bubble: of the (M + K - 1) clock ticks, each stage idles K - 1; with perfect overlap the
        # pipelined step takes (M + K - 1) / (M K) of the plain split's time
        row["bubble_fraction"] = (k - 1) / (m + k - 1)
        row["ideal_speedup_vs_plain_split"] = m * k / (m + k - 1) if k > 1 else None
    return {"batch": list(spec["input"].shape), "cut": spec["cut"], "rows": rows}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(results["workloads"])
    fig, axes = plt.subplots(2, len(nets), figsize=(6 * len(nets), 8), squeeze=False)
    for col, name in enumerate(nets):
        rows = results["workloads"][name]["rows"]
        labels = ["one device", "plain split (M=1)", f"pipelined M={results['best_m'][name]}"]
        med = [rows[label]["median_s"] for label in labels]
        err = [
            [m - rows[label]["min_s"] for m, label in zip(med, labels)],
            [rows[label]["max_s"] - m for m, label in zip(med, labels)],
        ]
        ax = axes[0][col]
        ax.bar(range(3), med, yerr=err, capsize=6, color=["#888888", "#c44e52", "#4c72b0"])
        ax.set_xticks(range(3), labels)
        ax.set_ylabel("seconds per step (median, min-max)")
        ax.set_title(f"{name}: batch {results['workloads'][name]['batch']}, cut {results['workloads'][name]['cut']}")
        sweep = [label for label in rows if label.startswith("pipelined")]
        ms = [rows[label]["micro_batches"] for label in sweep]
        ax = axes[1][col]
        ax.plot(ms, [rows[label]["speedup_vs_plain_split"] for label in sweep], "o-", label="measured")
        ax.plot(
            ms,
            [rows[label]["ideal_speedup_vs_plain_split"] for label in sweep],
            "--",
            label="ideal: M K / (M + K - 1), bubble (K-1)/(M+K-1)",
        )
        ax.axhline(rows["one device"]["speedup_vs_plain_split"], color="#888888", ls=":", label="one device")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M (K = 2 stages)")
        ax.set_ylabel("speed-up over the plain split")
        ax.legend(fontsize=8)
    fig.suptitle(f"pipe on {results['machine']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sweep", type=int, nargs="+", default=[2, 4, 8, 16])
    args = parser.parse_args()
    torch.manual_seed(0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {cores} cores, torch {torch.__version__}",
        "workloads": {},
        "best_m": {},
    }
    for name, spec in workloads().items():
        results["workloads"][name] = measure(name, spec, args.sweep, args.repeats, cores)
        rows = results["workloads"][name]["rows"]
        best = max((r for r in rows if r.startswith("pipelined")), key=lambda r: rows[r]["samples_per_s"])
        results["best_m"][name] = rows[best]["micro_batches"]
        for label, row in rows.items():
            print(f"{name:9s} {label:20s} {row['median_s'] * 1000:8.1f} ms  x{row['speedup_vs_plain_split']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "pipeline.png")
    print(f"wrote {RESULTS / 'pipeline.json'} and {RESULTS / 'pipeline.png'}")


if __name__ == "__main__":
    main()
