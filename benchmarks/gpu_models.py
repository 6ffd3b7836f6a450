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
  metrics and loaders at their defaults, the data a synthetic TensorDataModule (this file's SyntheticImages and
  SyntheticTokens), held on the device as the template holds small data sets; compile as a user asks for it
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
import gc
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from engine.data.tensors import TensorDataModule, TensorDataset

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
LOOPS = ("hand-written", "bare Lightning", "this template")
DATA = ("on device", "DataLoader")
PRECISION = "bf16-mixed"


@dataclass(frozen=True)
class Shape:
    batch: int
    image: int = 224  # resnet50
    classes: int = 1000
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    context: int = 1024  # gpt2
    layers: int = 12
    heads: int = 12
    embd: int = 768


SHAPES = {
    "resnet50": {"full": Shape(batch=128), "tiny": Shape(batch=4, image=32, classes=10, blocks=(1, 1, 1, 1), width=16)},
    "gpt2": {"full": Shape(batch=16), "tiny": Shape(batch=4, context=32, layers=2, heads=2, embd=32)},
}


# --- the nets ---------------------------------------------------------------------------------------------------


def resnet50(
    num_classes: int = 1000,
    weights: Any = None,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    compile: bool | str = False,
) -> nn.Module:
    """torchvision's ResNet-50 (Bottleneck blocks 3-4-6-3, width 64), channels_last, taking any input (made
    channels_last in forward: a no-op for input that is). `blocks`, `width`: the tiny shape's. `weights`: what
    model=torchvision passes (null)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    class ChannelsLastResNet(ResNet):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x.contiguous(memory_format=torch.channels_last))

    assert weights is None, "synthetic data: no pretrained weights"
    net = ChannelsLastResNet(Bottleneck, list(blocks), num_classes=num_classes, width_per_group=width)
    net = net.to(memory_format=torch.channels_last)
    if compile:
        net.compile(**({"backend": compile} if isinstance(compile, str) else {}))
    return net


def gpt(
    block_size: int = 1024, n_layer: int = 12, n_head: int = 12, n_embd: int = 768, dropout: float = 0.0, compile=False
) -> nn.Module:
    """The template's GPT (project.models.gpt), compiled in place when asked, as the classifier compiles its net."""
    from project.models.gpt import GPT

    net = GPT(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)
    if compile:
        net.compile(**({"backend": compile} if isinstance(compile, str) else {}))
    return net


def build(model: str, shape: Shape, compile: bool | str = False) -> nn.Module:
    if model == "resnet50":
        return resnet50(shape.classes, blocks=shape.blocks, width=shape.width, compile=compile)
    return gpt(shape.context, shape.layers, shape.heads, shape.embd, compile=compile)


def loss_of(model: str) -> Callable[[Tensor, Tensor], Tensor]:
    if model == "resnet50":
        return F.cross_entropy
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def optimizer_of(model: str, params: Any) -> torch.optim.Optimizer:
    if model == "resnet50":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.0005)
    return torch.optim.AdamW(params, lr=0.001, weight_decay=0.01)


def pool(model: str, shape: Shape, n: int, device: torch.device | str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor]:
    """`n` synthetic samples: images (n, 3, H, W) standardised and labels, or token windows and the tokens after."""
    g = torch.Generator().manual_seed(seed)
    if model == "resnet50":
        x = torch.randn(n, 3, shape.image, shape.image, generator=g)
        y = torch.randint(shape.classes, (n,), generator=g)
    else:
        tokens = torch.randint(256, (n, shape.context + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return x.to(device), y.to(device)


def flops_per_sample(model: str, shape: Shape) -> int:
    """FLOPs of one sample's forward, loss and backward, as torch's FlopCounterMode counts them (on the meta device:
    nothing is computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = 2
    with torch.device("meta"):
        net = build(model, shape)
        x, y = pool(model, Shape(**{**asdict(shape), "batch": batch}), batch, "meta")
    with FlopCounterMode(display=False) as counter:
        loss_of(model)(net(x), y).backward()
    return counter.get_total_flops() // batch


# --- data -------------------------------------------------------------------------------------------------------


class DeviceBatches(Dataset):
    """`length` batches drawn at random from samples already on the device (DataLoader(batch_size=None) hands
    them on as they are)."""

    def __init__(self, samples: tuple[Tensor, Tensor], batch: int, length: int) -> None:
        self.x, self.y = samples
        self.batch, self.length = batch, length
        self.generator = torch.Generator(device=self.y.device).manual_seed(0)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.y), (self.batch,), device=self.y.device, generator=self.generator)
        return self.x[idx], self.y[idx]


class HostSamples(Dataset):
    """`length` samples on the host, cycling through a pool: a DataLoader collates them in its workers."""

    def __init__(self, samples: tuple[Tensor, Tensor], length: int) -> None:
        self.x, self.y = samples
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        j = i % len(self.y)
        return self.x[j], self.y[j]


def host_loader(samples: tuple[Tensor, Tensor], batch: int, batches: int, workers: int, cuda: bool) -> DataLoader:
    return DataLoader(
        HostSamples(samples, batch * batches),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=False,
    )


class PooledTensors(TensorDataset):
    """The template's TensorDataset over `length` samples that cycle through a pool (a few hundred ImageNet-size
    images, not the whole epoch's gigabytes)."""

    def __init__(self, images: Tensor, labels: Tensor, length: int) -> None:
        super().__init__(images, labels)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        device = self.labels.device
        idx = torch.as_tensor(indices).remainder_(len(self.labels)).to(device, non_blocking=device.type == "cuda")
        return self.images[idx], self.labels[idx]

    def to(self, device: torch.device) -> "PooledTensors":
        return PooledTensors(self.images.to(device), self.labels.to(device), self.length)


class _Synthetic(TensorDataModule):
    """A template data module of synthetic samples: `batches` training batches, one of validation and of test.
    Takes (and ignores) the keys of the data config it replaces (`data._target_=gpu_models.<class>`)."""

    model = ""

    def __init__(self, batch_size: int, batches: int, pool_size: int, shape: dict, on_device: bool = True, **_: Any):
        super().__init__(batch_size=batch_size, on_device=on_device, shuffle=True)
        self.batches, self.pool_size, self.shape = batches, pool_size, Shape(**dict(shape))

    def load_splits(self) -> dict[str, TensorDataset]:
        x, y = pool(self.model, self.shape, self.pool_size)
        return {
            "train": PooledTensors(x, y, self.batch_size * self.batches),
            "val": PooledTensors(x, y, self.batch_size),
            "test": PooledTensors(x, y, self.batch_size),
        }


class SyntheticImages(_Synthetic):
    model = "resnet50"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes = self.shape.classes  # checked against the model's by the template


class SyntheticTokens(_Synthetic):
    model = "gpt2"


# --- timing -----------------------------------------------------------------------------------------------------


def settled(device: torch.device) -> float:
    """The time once the device has done the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepTimer(L.Callback):
    """Times training steps `warmup` .. `warmup + steps - 1` of the fit (the device synchronised before and after),
    counts their samples and the peak memory allocated meanwhile; writes them to `path` (JSON) when given."""

    def __init__(self, warmup: int, steps: int, path: str | None = None) -> None:
        self.warmup, self.steps, self.path = warmup, steps, path
        self.result: dict[str, Any] | None = None
        self._seen = self._samples = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self._seen == self.warmup:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, batch: Any, i: int):
        self._seen += 1
        if self._seen > self.warmup:
            self._samples += len(batch[1])
        if self._seen == self.warmup + self.steps:
            device = pl_module.device
            self.result = {
                "seconds": settled(device) - self._start,
                "steps": self.steps,
                "samples": self._samples,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            }
            if self.path:
                Path(self.path).write_text(json.dumps(self.result) + "\n")


def fresh(device: torch.device) -> None:
    """Nothing of the run before: its tensors freed, the compiled graphs and their guards dropped."""
    import torch._dynamo

    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hand_written(model: str, shape: Shape, data: str, compile: bool | str, args: argparse.Namespace) -> dict:
    device = args.device
    fresh(device)
    torch.manual_seed(0)
    net = build(model, shape, compile).to(device)
    optimizer, loss_fn = optimizer_of(model, net.parameters()), loss_of(model)
    total = args.warmup + args.steps
    if data == "on device":
        batches = iter(DeviceBatches(pool(model, shape, args.pool, device), shape.batch, total))
    else:
        loader = host_loader(pool(model, shape, args.pool), shape.batch, total, args.workers, device.type == "cuda")
        batches = ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)
    net.train()
    start = 0.0
    for step in range(total):
        if step == args.warmup:
            start = settled(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        x, y = next(batches)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    seconds = settled(device) - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"seconds": seconds, "steps": args.steps, "samples": args.steps * shape.batch, "peak_memory_bytes": peak}


class BareModule(L.LightningModule):
    """The hand-written step in a plain LightningModule, and nothing else."""

    def __init__(self, model: str, net: nn.Module) -> None:
        super().__init__()
        self.model_name, self.net, self.loss_fn = model, net, loss_of(model)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.model_name, self.parameters())


def bare_lightning(model: str, shape: Shape, data: str, compile: bool | str, args: argparse.Namespace) -> dict:
    device = args.device
    fresh(device)
    torch.manual_seed(0)
    module = BareModule(model, build(model, shape, compile))
    total = args.warmup + args.steps
    if data == "on device":
        loader = DataLoader(DeviceBatches(pool(model, shape, args.pool, device), shape.batch, total), batch_size=None)
    else:
        loader = host_loader(pool(model, shape, args.pool), shape.batch, total, args.workers, device.type == "cuda")
    timer = StepTimer(args.warmup, args.steps)
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision=PRECISION,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=loader)
    assert timer.result is not None, "the fit ended before its timed steps"
    return timer.result


def template_overrides(model: str, shape: Shape, compile: bool | str, args: argparse.Namespace, out: Path) -> list:
    total = args.warmup + args.steps
    shape_override = "+data.shape={" + ",".join(f"{k}:{list(v) if isinstance(v, tuple) else v}"
                                                for k, v in asdict(shape).items()) + "}"  # fmt: skip
    common = [
        f"hydra.run.dir={out / 'run'}",
        f"trainer.accelerator={'gpu' if args.device.type == 'cuda' else 'cpu'}",
        "trainer.devices=1",
        "precision=bf16_mixed",
        "trainer.max_epochs=1",
        f"+trainer.limit_train_batches={total}",
        "+trainer.limit_val_batches=1",
        "+trainer.benchmark=true",  # cudnn.benchmark, as in the other loops
        "test=false",
        "model/scheduler=none",  # the other loops have none (a schedule stepped once an epoch costs nothing here)
        f"data.batch_size={shape.batch}",
        f"+data.batches={total}",
        f"+data.pool_size={args.pool}",
        shape_override,
        "+callbacks.step_timer._target_=gpu_models.StepTimer",
        f"+callbacks.step_timer.warmup={args.warmup}",
        f"+callbacks.step_timer.steps={args.steps}",
        f"+callbacks.step_timer.path={out / 'steps.json'}",
    ]
    if model == "resnet50":
        return [
            *common,
            "model=torchvision",
            "model.net._target_=gpu_models.resnet50",
            f"model.num_classes={shape.classes}",
            f"+model.net.blocks={list(shape.blocks)}",
            f"+model.net.width={shape.width}",
            f"model.compile={str(compile).lower() if isinstance(compile, bool) else compile}",
            "data._target_=gpu_models.SyntheticImages",
        ]
    return [
        *common,
        "model=gpt",
        "data=text",
        "model.net._target_=gpu_models.gpt",
        f"model.net.block_size={shape.context}",
        f"model.net.n_layer={shape.layers}",
        f"model.net.n_head={shape.heads}",
        f"model.net.n_embd={shape.embd}",
        f"+model.net.compile={str(compile).lower() if isinstance(compile, bool) else compile}",
        "data._target_=gpu_models.SyntheticTokens",
    ]


def this_template(model: str, shape: Shape, compile: bool | str, args: argparse.Namespace) -> dict:
    """`python train.py <overrides>` in a process of its own, timed from inside by StepTimer."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=args.work))
    cmd = [sys.executable, str(REPO / "train.py"), *template_overrides(model, shape, compile, args, out)]
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    if args.device.type == "cpu":
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # as many threads as the loops in this process
    proc = subprocess.run(cmd, cwd=args.work, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "steps.json").is_file():
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    timed = json.loads((out / "steps.json").read_text())
    shutil.rmtree(out, ignore_errors=True)  # its checkpoints: up to 1 GB a run at the full shapes
    return timed


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
    sys.path.insert(0, str(BENCHMARKS))  # the subprocesses import this file as gpu_models: so may this one
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
