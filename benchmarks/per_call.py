"""`make bench`: what six per-call costs of the training loop are, with Lightning's and the template's way.

- `self.log` of a step value and of a metric object: Lightning's result collection with its own `_ResultMetric.to`
  (a move to the device on every call) and with engine.loggers.logged_values' (no move when already there);
- a training step's metric updates: torchmetrics' MeanMetric and MulticlassAccuracy, as the classifier makes them
  (a batch of 64, 10 classes);
- a checkpoint save, as long as it holds the training thread: written there (fsync and rename included), and
  handed to the writer thread (engine.runs.atomic_io; the write itself is waited for outside the timing), for the
  MLP 784-64-128-64 and for ResNet-18 (11M weights), each with Adam's two moments, each net in rounds of its own
  (the disk is still flushing ResNet-18's 45 MB files for a while); and an epoch's end, where the best file and
  last.ckpt are saved one after the other (the second does not wait for the first's write), or last.ckpt is made
  from the best file (a hard link, when both hold the same state; Lightning's collection of the state, which that
  also saves, is not in this timing).
- the copy of the logged metrics that both checkpoint callbacks make before every save decision (twice an epoch),
  for a classifier's eight: Lightning's `ModelCheckpoint._monitor_candidates` (a deep copy of each tensor) and
  engine.callbacks.checkpoint's (a clone of each);
- a TensorBoard `log_metrics` call with an epoch's four validation scalars: Lightning's logger (an event per
  scalar, each handed to the writer thread at once) and engine.loggers.tensorboard's (one event a call), both
  writing to a local folder; the template's holds its events and hands them over in batches (after a checkpoint,
  every `flush_secs`, at the end), so it is timed twice: as it runs (the hand-over is not in the call) and handing
  each call's event over at once, as before (and as a ddp_spawn worker's logger does);
- an optimizer step (Adam on the MLP, a batch of 64's gradients): with Lightning's NVML-based CUDA check, which on a
  machine without a GPU looks for the NVML library at every step, and answered by the CUDA runtime's cached count, as
  the template sets it when no GPU is visible (engine.launch.devices). Only with the CUDA build of torch.
Rounds interleaved. Writes benchmarks/results/per_call.json.
"""

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
from timing import interleaved, summary, write_results
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from engine.callbacks.checkpoint import BestCheckpoint
from engine.launch.devices import NVML_CHECK
from engine.loggers import logged_values
from engine.runs.atomic_io import AtomicCheckpointIO
from project.models.mlp import MLP
from project.models.resnet import ResNet18


def per_call_us(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def logging(to: Any, calls: int) -> dict[str, Callable[[], float]]:
    """self.log's core: `_ResultCollection.log` of a step value, and of a metric object, with `to` installed."""

    def timed(metric: bool) -> float:
        _ResultMetric.to = to  # type: ignore[method-assign]
        results = _ResultCollection(training=True)
        value: Any = MeanMetric() if metric else torch.tensor(0.5)
        if metric:
            value.update(torch.tensor(0.5))
        log = partial(results.log, "training_step", "loss", value, on_step=not metric, on_epoch=metric, batch_size=64)
        log()  # the first call registers the result object
        return per_call_us(log, calls)

    return {"step value": partial(timed, False), "metric object": partial(timed, True)}


def metric_updates(calls: int) -> dict[str, Callable[[], float]]:
    preds, target, loss = torch.randint(0, 10, (64,)), torch.randint(0, 10, (64,)), torch.tensor(0.5)
    torchmetrics_own = (
        MeanMetric(nan_strategy="disable"),
        MulticlassAccuracy(10, average="micro", validate_args=False),
    )

    def timed(mean: Any, accuracy: Any) -> float:
        return per_call_us(lambda: (mean.update(loss), accuracy.update(preds, target)), calls)

    return {
        "torchmetrics": partial(timed, *torchmetrics_own),
    }


def checkpoint(net: torch.nn.Module) -> dict[str, Any]:
    weights = net.state_dict()
    moments = {
        k: {"exp_avg": v.clone(), "exp_avg_sq": v.clone(), "step": torch.tensor(1.0)} for k, v in weights.items()
    }
    return {"state_dict": weights, "optimizer_states": [{"state": moments}], "epoch": 1}


def metric_snapshots(calls: int) -> dict[str, Callable[[], float]]:
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    names = ("val/loss", "val/acc", "val/acc_best", "train/loss_epoch", "train/acc", "lr-Adam", "epoch", "step")
    trainer = SimpleNamespace(callback_metrics={name: torch.tensor(0.5) for name in names}, current_epoch=3)
    trainer.global_step = 165
    lightnings, mine = ModelCheckpoint(), BestCheckpoint()
    return {
        "Lightning's (deep copies)": lambda: per_call_us(lambda: lightnings._monitor_candidates(trainer), calls),
        "engine.callbacks.checkpoint (clones)": lambda: per_call_us(lambda: mine._monitor_candidates(trainer), calls),
    }


def tensorboard_writes(calls: int, folder: Path) -> dict[str, Callable[[], float]]:
    from lightning.pytorch.loggers import TensorBoardLogger as LightningsLogger

    from engine.loggers.tensorboard import TensorBoardLogger

    metrics = {"val/loss": torch.tensor(0.3), "val/acc": torch.tensor(0.9), "val/acc_best": torch.tensor(0.92)}
    at_once = TensorBoardLogger(str(folder), name="template_at_once")
    at_once._flush_secs = 0.0  # what a ddp_spawn worker's copy sets: nothing held (a flush_secs=0 writer would spin)
    loggers = {
        "Lightning's (an event a scalar)": LightningsLogger(str(folder), name="lightning", default_hp_metric=False),
        "engine.loggers.tensorboard (an event a call, held)": TensorBoardLogger(str(folder), name="template"),
        "engine.loggers.tensorboard, handed over at once": at_once,
    }
    return {
        name: partial(lambda logger: per_call_us(lambda: logger.log_metrics({**metrics, "epoch": 3}, 7), calls), logger)
        for name, logger in loggers.items()
    }


def optimizer_steps(calls: int) -> dict[str, Callable[[], float]]:
    net = MLP(hidden=[64, 128, 64])
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(64, 1, 28, 28)).logsumexp(1).mean().backward()

    def timed(check: str) -> float:
        os.environ[NVML_CHECK] = check
        return per_call_us(optimizer.step, calls)

    return {"Lightning's NVML check": partial(timed, "1"), "runtime's cached count": partial(timed, "0")}


def saves(folder: Path) -> dict[str, dict[str, Callable[[], float]]]:
    io = AtomicCheckpointIO()
    nets = {"MLP": MLP(hidden=[64, 128, 64]), "ResNet-18": ResNet18()}

    def timed(state: dict[str, Any], target: Path, background: bool) -> float:
        io.wait()
        start = time.perf_counter()
        if background:
            with io.in_background(target):
                io.save_checkpoint(state, target)
        else:
            io.save_checkpoint(state, target)
        took = time.perf_counter() - start
        io.wait()
        return took * 1e6

    def back_to_back(state: dict[str, Any], link: bool = False) -> float:
        """An epoch's end: its best file, then last.ckpt at once (the writer still writing the first); `link`:
        last.ckpt made from the best file, as engine.callbacks.checkpoint does when both hold the same state."""
        io.wait()
        best, last = folder / "best.ckpt", folder / "last.ckpt"
        start = time.perf_counter()
        with io.in_background(best):
            io.save_checkpoint(state, best)
        with io.in_background(last):
            if link:
                io.save_copy(best, last)
            else:
                io.save_checkpoint(state, last)
        took = time.perf_counter() - start
        io.wait()
        return took * 1e6

    groups: dict[str, dict[str, Callable[[], float]]] = {}
    for name, net in nets.items():  # each net in rounds of its own: after ResNet-18's 45 MB writes the disk is busy
        state, rows = checkpoint(net), {}
        for background in (False, True):
            how = "handed to the writer thread" if background else "written on the training thread"
            rows[how] = partial(timed, state, folder / f"{name}.ckpt", background)
        groups[f"checkpoint save of the {name}, µs of the training thread"] = rows
    mlp = groups["checkpoint save of the MLP, µs of the training thread"]
    mlp["best, then last.ckpt at once, both handed over"] = partial(back_to_back, checkpoint(nets["MLP"]))
    mlp["best, then last.ckpt made from it (a hard link)"] = partial(back_to_back, checkpoint(nets["MLP"]), True)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500, help="log calls and metric updates per timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lightnings, folder = logged_values._lightnings_to, Path(tempfile.mkdtemp(prefix="bench-per-call-"))
    groups = {
        "self.log, µs a call": {
            **{f"{k}, Lightning's move": v for k, v in logging(lightnings, args.calls).items()},
            **{f"{k}, move skipped": v for k, v in logging(logged_values._to, args.calls).items()},
        },
        "metric updates, µs a training step": metric_updates(args.calls),
        "checkpoint callbacks' copy of eight logged metrics, µs a call": metric_snapshots(args.calls),
        "TensorBoard log_metrics of four scalars, µs a call": tensorboard_writes(args.calls, folder),
        "Adam's step on the MLP, µs, no GPU": optimizer_steps(args.calls),
        **saves(folder),
    }
    results: dict[str, Any] = {"repeats": args.repeats, "calls": args.calls}
    for group, configs in groups.items():
        rows = {name: summary(values) for name, values in interleaved(configs, args.repeats, warmup=1).items()}
        results[group] = rows
        for name, row in rows.items():
            print(f"{group:44s} {name:52s} {row['median']:10.1f}")
    _ResultMetric.to = lightnings  # type: ignore[method-assign]
    print(f"wrote {write_results('per_call', results)}")


if __name__ == "__main__":
    main()
