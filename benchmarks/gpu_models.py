"""`make bench-gpu`: real-size models on one CUDA GPU, the template's training loop against a hand-written PyTorch
loop and a bare LightningModule. Samples/s, MFU and peak memory, per model, torch.compile off and on, data already on
the device or through a DataLoader.

Models (the same net, optimizer and precision in every loop):
- resnet50: torchvision's ResNet-50 (25.6 M parameters, 1,000 classes) on synthetic ImageNet-size batches
  (3x224x224, float32 in, normalised already), channels_last (weights and input), SGD (lr 0.05, momentum 0.9,
  weight decay 5e-4: conf/model/optimizer/sgd.yaml), batch 128;
- gpt2: a GPT-2-small-sized transformer (12 layers, 12 heads, 768 wide, 1,024 context), the template's own
  project.models.gpt.GPT, on synthetic tokens, AdamW (lr 1e-3, weight decay 0.01: conf/model/gpt.yaml), batch 16
  (16,384 tokens a step). Its vocabulary is the template's 256 bytes, not GPT-2's 50,257: 86 M parameters, not 124 M.
All in bf16 autocast (`precision=bf16_mixed`, Lightning's "bf16-mixed"), float32 weights, TF32 for float32 matmuls
(torch.backends.cuda.matmul.allow_tf32, the template's float32_matmul_precision=high), cudnn.benchmark on.

Loops, in interleaved rounds (one run of each per round):
- hand-written: plain PyTorch, `with torch.autocast(...)`: forward, loss, zero_grad, backward, step;
- bare Lightning: the same step in a plain LightningModule and Trainer (no logger, checkpoints, progress bar, summary
  or sanity check);
- this template: `python train.py` (a subprocess) with the same net, optimizer and precision, its callbacks, logger,
  metrics and loaders at their defaults, the data a synthetic TensorDataModule (gpu_workloads.py's SyntheticImages
  and SyntheticTokens), held on the device as the template holds small data sets; compile as a user asks for it
  (`model.compile=true` for the classifier; the GPT's net compiled by its factory, the same `nn.Module.compile`).
Data "on device": a pool of samples on the GPU, each batch indexed out of it. "DataLoader": a torch DataLoader over
host tensors, `num_workers` worker processes, pinned memory, each batch copied to the device (non_blocking).

Timing: `--warmup` steps first (compilation, cudnn's autotuning, the allocator, the template's first-step work), then
`--steps` steps timed with torch.cuda.synchronize() before and after (no synchronisation in between that the loop does
not do itself). Peak memory: torch.cuda.max_memory_allocated over the timed steps. MFU: the FLOPs of one training
step (forward, loss and backward, counted by torch.utils.flop_counter.FlopCounterMode on the meta device: matrix
products, convolutions, attention counted whole though it is causal) times steps/s, over the device's bf16 peak from
Lightning's throughput table (lightning.fabric.utilities.throughput; an H200 by engine.callbacks.throughput's lookup
of the same table, whose H200 figure is the sparse 2.0e15, twice the dense peak: `--peak-flops 9.89e14` for the
dense one). On CPU MFU is null.

`--tiny` (and on a machine without a CUDA GPU always): a tiny shape (ResNet of one block a stage and width 16 on
32x32 images, a 2-layer GPT 32 wide on 32 tokens; batch 4, 2 + 3 steps), compile off unless asked: what
tests/test_bench_gpu.py runs on CPU in well under a minute. Writes benchmarks/results/gpu_models_<device>.json and .png
(`--out` for another folder).
"""

import argparse
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

import torch
from gpu_loops import BENCHMARKS, PRECISION, bare_lightning, hand_written, this_template
from gpu_workloads import SHAPES, flops_per_sample

LOOPS = ("hand-written", "bare Lightning", "this template")
DATA = ("on device", "DataLoader")


# --- the benchmark ----------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from timing import machine

    return machine().split(",")[0]  # the CPU's model name


def peak_flops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    """One device's bf16 peak FLOP/s and where it comes from: `given`, Lightning's table, or none (a CPU)."""
    if given:
        return given, "--peak-flops"
    if device.type != "cuda":
        return None, "none: a CPU has no entry in Lightning's table"
    from lightning.fabric.utilities.throughput import get_available_flops

    from engine.callbacks.throughput import _peak_lightning_misses

    found = get_available_flops(device, torch.bfloat16) or _peak_lightning_misses(device, torch.bfloat16)
    return (float(found), "Lightning's throughput table (bf16)") if found else (None, "not in Lightning's table")


def model_is_text(model: str) -> bool:
    return model == "gpt2"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size = "tiny" if args.tiny else "full"
    peak, peak_source = peak_flops(args.device, args.peak_flops)
    configs: dict[str, tuple[dict[str, Any], Callable[[], dict]]] = {}
    for model in args.models:
        shape = SHAPES[model][size]
        flops = flops_per_sample(model, shape)
        for compile_on in args.compile:
            compile: bool | str = False if compile_on == "off" else (args.compile_backend or True)
            for loop in args.loops:
                for data in DATA if loop != "this template" else ("template's loader, on device",):
                    row = {"model": model, "compile": compile_on, "loop": loop, "data": data}
                    row.update(batch_size=shape.batch, shape=asdict(shape), flops_per_sample=flops)
                    label = f"{model} | compile {compile_on} | {loop}, {data}"
                    if loop == "hand-written":
                        run = lambda m=model, s=shape, d=data, c=compile: hand_written(m, s, d, c, args)  # noqa: E731
                    elif loop == "bare Lightning":
                        run = lambda m=model, s=shape, d=data, c=compile: bare_lightning(m, s, d, c, args)  # noqa: E731
                    else:
                        run = lambda m=model, s=shape, c=compile: this_template(m, s, c, args)  # noqa: E731
                    configs[label] = (row, run)
    rows = []
    kept: dict[str, list[dict]] = {label: [] for label in configs}
    for _ in range(args.repeats):  # interleaved: one run of each per round
        for label, (_, run) in configs.items():
            kept[label].append(run())
    for label, (row, _) in configs.items():
        rates = [r["samples"] / r["seconds"] for r in kept[label]]
        rate = median(rates)
        peaks = [r["peak_memory_bytes"] for r in kept[label] if r["peak_memory_bytes"] is not None]
        row.update(
            label=label,
            samples_per_s=rate,
            min=min(rates),
            max=max(rates),
            samples=rates,
            step_ms=1000 * median([r["seconds"] / r["steps"] for r in kept[label]]),
            tokens_per_s=rate * row["shape"]["context"] if model_is_text(row["model"]) else None,
            flops_per_s=rate * row["flops_per_sample"],
            mfu=rate * row["flops_per_sample"] / peak if peak else None,
            peak_memory_gib=max(peaks) / 2**30 if peaks else None,
        )
        mfu = f"MFU {row['mfu']:.1%}" if row["mfu"] is not None else "MFU -"
        memory = f"{row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else "-"
        print(f"{label:72s} {rate:10.1f} samples/s  {row['step_ms']:8.1f} ms/step  {mfu}  peak {memory}")
        rows.append(row)
    return {
        "device": device_name(args.device),
        "accelerator": args.device.type,
        "tiny": args.tiny,
        "precision": PRECISION,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "dataloader_workers": args.workers,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def figure(results: dict[str, Any], path: Path) -> None:
    from plotting import bars, pyplot

    plt = pyplot()
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for row in results["rows"]:
        name = f"{row['loop']}, {row['data']}".replace("template's loader, on device", "template's loader")
        groups.setdefault((row["model"], row["compile"]), {})[name] = {
            "median": row["samples_per_s"],
            "min": row["min"],
            "max": row["max"],
        }
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 5.5), squeeze=False)
    for ax, ((model, compile_on), rows) in zip(axes[0], groups.items()):
        bars(rows, path, f"{model}, compile {compile_on}", "samples/s (median, min-max)", ax=ax)
    size = " (tiny shapes)" if results["tiny"] else ""
    fig.suptitle(f"Training samples/s on {results['device']}{size}: same net, optimizer, bf16 autocast")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, a few steps (always without a GPU)")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], help="default: off on (tiny: off)")
    parser.add_argument("--compile-backend", help="torch.compile's backend (default: inductor; eager for a check)")
    parser.add_argument("--warmup", type=int, help="steps before the timed ones (default 10; tiny 2)")
    parser.add_argument("--steps", type=int, help="timed steps (default 50; tiny 3)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 3; tiny 1)")
    parser.add_argument("--workers", type=int, help="DataLoader worker processes (default: min(8, cores - 1); tiny 1)")
    parser.add_argument("--pool", type=int, help="distinct synthetic samples (default 512; tiny 16)")
    parser.add_argument("--threads", type=int, default=1, help="CPU only: torch's intra-op threads")
    parser.add_argument("--peak-flops", type=float, help="the device's bf16 peak FLOP/s for MFU (default: Lightning's)")
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results", help="where the JSON and PNG go")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    tiny = args.tiny
    args.device = torch.device("cuda" if cuda else "cpu")
    args.compile = args.compile or (["off"] if tiny else ["off", "on"])
    args.warmup = args.warmup if args.warmup is not None else (2 if tiny else 10)
    args.steps = args.steps or (3 if tiny else 50)
    args.repeats = args.repeats or (1 if tiny else 3)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.workers = args.workers if args.workers is not None else (1 if tiny else max(1, min(8, cores - 1)))
    args.pool = args.pool or (16 if tiny else 512)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # the template's float32_matmul_precision=high
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # also Lightning's here: it keeps the session's value
    else:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the bare fits' start-up lines, each time
    warnings.filterwarnings("ignore", message=".*(srun. command is available|LeafSpec).*")
    sys.path.insert(0, str(BENCHMARKS))  # the subprocesses import gpu_loops and gpu_workloads: so may this one
    from engine.config import register

    register()
    args.work = Path(tempfile.mkdtemp(prefix="bench-gpu-models-"))
    try:
        results = measure(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    slug = re.sub(r"[^a-z0-9]+", "-", "cpu" if not cuda else results["device"].lower()).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_models_{slug}.json"
    from timing import machine

    stamped = {"date": date.today().isoformat(), "machine": machine(), "python": platform.python_version(), **results}
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    figure(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
