"""The three loops gpu_models.py compares (hand-written, bare Lightning, this template), each timing its steps alike."""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from gpu_workloads import DeviceBatches, Shape, build, host_loader, loss_of, optimizer_of, pool
from torch import Tensor, nn
from torch.utils.data import DataLoader

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
PRECISION = "bf16-mixed"


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
        "+callbacks.step_timer._target_=gpu_loops.StepTimer",
        f"+callbacks.step_timer.warmup={args.warmup}",
        f"+callbacks.step_timer.steps={args.steps}",
        f"+callbacks.step_timer.path={out / 'steps.json'}",
    ]
    if model == "resnet50":
        return [
            *common,
            "model=torchvision",
            "model.net._target_=gpu_workloads.resnet50",
            f"model.num_classes={shape.classes}",
            f"+model.net.blocks={list(shape.blocks)}",
            f"+model.net.width={shape.width}",
            f"model.compile={str(compile).lower() if isinstance(compile, bool) else compile}",
            "data._target_=gpu_workloads.SyntheticImages",
        ]
    return [
        *common,
        "model=gpt",
        "data=text",
        "model.net._target_=gpu_workloads.gpt",
        f"model.net.block_size={shape.context}",
        f"model.net.n_layer={shape.layers}",
        f"model.net.n_head={shape.heads}",
        f"model.net.n_embd={shape.embd}",
        f"+model.net.compile={str(compile).lower() if isinstance(compile, bool) else compile}",
        "data._target_=gpu_workloads.SyntheticTokens",
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
