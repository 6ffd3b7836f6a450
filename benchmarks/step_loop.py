"""`make bench` figure 3: the template's training loop against a hand-written PyTorch loop, time per epoch, on the
default LeNet and on the 784-64-128-64 MLP. Same net (built from the same config), same batches (the default
digits' 3,500 training and 500 validation digits, batch 64, reshuffled each epoch), same device, same optimizer
(Adam, lr 0.002, cosine schedule stepped per epoch); each epoch trains, then validates.

Three loops, in interleaved rounds, one fit of each per round, in this process:
- hand-written: plain PyTorch, nothing but the step and a validation pass;
- bare LightningModule: the same step in Lightning, with no logger, no callbacks, no progress bar, no metrics, and
  Lightning's NVML-based CUDA check, which without a GPU costs every optimizer step a failed library lookup (also
  timed without it: "bare, no NVML check", what the template sets when no GPU is visible);
- this template: `project.tasks.train` on the composed config (metrics, logging, progress bar,
  checkpoints, TensorBoard), as `python train.py` would run it, with benchmarks/epoch_timer.py added.
The first epoch of every fit (set-up, sanity check, allocator warm-up) and the last (the fit's end: the template
draws the figures it held back, agrees once more and waits for its checkpoint writer; bare Lightning has less to
do) are left out of the per-epoch figures: the last one's extra time over the fit's other epochs is reported apart,
as `fit_end_ms`, a cost paid once a fit. With 3-epoch fits, as this benchmark had until 2026-11-26, every other
epoch counted was a last one, and the once-a-fit costs read as an epoch's.
Target (issue 21): the template <= 1.10x the bare LightningModule on both nets, its features at their defaults.

Each row also splits the epoch into its training steps (`train_median`: first batch to the last step's hooks) and
what comes after them once an epoch (`epoch_end_ms`: validation, checkpoints, figures). On the MLP the template is
also timed with each once-an-epoch feature turned off as the README says (what each costs), and on an epoch the
size of MNIST's training split (the digits repeated 16 times: 56,000), where the once-an-epoch costs weigh 16
times less against the steps.
Writes benchmarks/results/step_loop.json and step_loop.png; with `--accelerator gpu` (one CUDA GPU, the data held
on it as the template holds small data sets, every loop on it) step_loop_gpu.json and step_loop_gpu.png. On a GPU
each epoch's times are read after the device has finished its work (a synchronisation once an epoch, in every
loop alike).
"""

import argparse
import copy
import functools
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from epoch_timer import EpochTimer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig
from plotting import bars, pyplot
from repeated_digits import RepeatedDigits
from timing import REPO, RESULTS, interleaved, summary, write_results
from torch import nn

from engine.config import register
from engine.launch.devices import NVML_CHECK
from project.tasks import train

MLP = ["model=mlp", "model.net.hidden=[64,128,64]"]
MNIST_SIZED = 16  # 16 x 3,500 = 56,000 training digits, MNIST's 55,000 after its validation split
# What each of the template's once-an-epoch features costs: the template with it turned off, as the README says
FEATURES_OFF = {
    "template, no checkpoints": ["~callbacks.model_checkpoint", "~callbacks.last_checkpoint"],
    "template, no figures": ["callbacks.tensorboard.images=false", "callbacks.tensorboard.confusion_matrix=false"],
    "template, logger=none": ["logger=none"],
    "template, no checkpoints, logger=none": [
        "~callbacks.model_checkpoint",
        "~callbacks.last_checkpoint",
        "logger=none",
    ],
}
WORKLOADS: dict[str, dict[str, Any]] = {
    "lenet": {"overrides": ["model=lenet"]},
    "mlp 784-64-128-64": {"overrides": MLP, "features_off": FEATURES_OFF},
    "mlp 784-64-128-64, MNIST-sized epoch": {"overrides": MLP, "repeat": MNIST_SIZED},
}
TARGET_TO_BARE = 1.10
LR = 0.002


def nvml_check(on: bool | None) -> None:
    """Lightning's NVML-based CUDA check: as importing Lightning leaves it (True), as the template sets it when no GPU
    is visible (False: engine.launch.devices, in this process too), or unset (no Lightning). Each loop gets what its
    user would have."""
    if on is None:
        os.environ.pop(NVML_CHECK, None)
    else:
        os.environ[NVML_CHECK] = "1" if on else "0"


def compose_cfg(overrides: list[str], out: Path, epochs: int, accelerator: str = "cpu") -> DictConfig:
    """The run config `python train.py <overrides>` would get, writing into `out`."""
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                *overrides,
                f"paths.root_dir={out}",
                f"paths.output_dir={out}",
                f"trainer.max_epochs={epochs}",
                f"trainer.accelerator={accelerator}",
                "test=false",
                "+callbacks.epoch_timer._target_=epoch_timer.EpochTimer",
                f"+callbacks.epoch_timer.path={out / 'epochs.json'}",
            ],
        )


def splits(repeat: int) -> dict[str, Any]:
    data = RepeatedDigits(repeat)
    data.setup()
    return data.splits


def settled(device: torch.device) -> float:
    """The time once the device has finished the work queued on it (a CUDA GPU runs behind the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def hand_written(
    net: nn.Module, data: dict[str, Any], epochs: int, batch: int, device: torch.device
) -> list[tuple[float, float]]:
    """The loop everyone writes first; returns (training steps, whole epoch) seconds per epoch."""
    nvml_check(None)  # no Lightning imported
    net.to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    criterion = nn.CrossEntropyLoss()
    x_train, y_train = data["train"].images.to(device), data["train"].labels.to(device)
    x_val, y_val = data["val"].images.to(device), data["val"].labels.to(device)
    times = []
    for _ in range(epochs):
        start = settled(device)
        net.train()
        for idx in torch.randperm(len(y_train), device=device).split(batch):
            loss = criterion(net(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        trained = settled(device) - start
        net.eval()
        correct = torch.zeros((), dtype=torch.long, device=device)
        with torch.no_grad():
            for i in range(0, len(y_val), batch):
                correct += (net(x_val[i : i + batch]).argmax(1) == y_val[i : i + batch]).sum()
        int(correct)  # the epoch's accuracy, read once
        scheduler.step()
        times.append((trained, settled(device) - start))
    return times


class BareModule(L.LightningModule):
    """The same step as the hand-written loop, in Lightning, and nothing else."""

    def __init__(self, net: nn.Module, epochs: int) -> None:
        super().__init__()
        self.net, self.epochs, self.criterion = net, epochs, nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.criterion(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        (self.net(x).argmax(1) == y).sum()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=LR)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)]


def bare_lightning(
    net: nn.Module, epochs: int, batch: int, repeat: int, out: Path, accelerator: str, nvml: bool = True
) -> list[tuple[float, float]]:
    nvml_check(nvml)
    timer = EpochTimer(str(out / "bare.json"))
    trainer = L.Trainer(
        accelerator=accelerator,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(BareModule(net, epochs), datamodule=RepeatedDigits(repeat, batch_size=batch))
    return [(e["train_s"], e["epoch_s"]) for e in timer.epochs]


def template(cfg: DictConfig) -> list[tuple[float, float]]:
    nvml_check(True)  # as importing Lightning leaves it; the template's trainer set-up decides
    train(cfg)
    epochs = json.loads((Path(cfg.paths.output_dir) / "epochs.json").read_text())["epochs"]
    return [(e["train_s"], e["epoch_s"]) for e in epochs]


def measure(
    name: str, workload: dict[str, Any], epochs: int, repeats: int, work: Path, accelerator: str
) -> dict[str, Any]:
    repeat = workload.get("repeat", 1)
    overrides = workload["overrides"]
    if repeat > 1:
        overrides = [*overrides, "data._target_=repeated_digits.RepeatedDigits", f"+data.repeat={repeat}"]
    probe = compose_cfg(overrides, work / "probe", epochs, accelerator)
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    torch.manual_seed(0)
    net = instantiate(probe.model.net)
    batch, data = int(probe.data.batch_size), splits(repeat)
    rounds, slug = iter(range(10**6)), re.sub("[^a-z0-9]+", "-", name)  # no commas in a Hydra override's path

    def templated(extra: list[str]) -> list[tuple[float, float]]:
        return template(compose_cfg([*overrides, *extra], work / f"{slug}-{next(rounds)}", epochs, accelerator))

    bare = functools.partial(
        bare_lightning, epochs=epochs, batch=batch, repeat=repeat, out=work, accelerator=accelerator
    )
    loops = {
        "hand-written": lambda: hand_written(copy.deepcopy(net), data, epochs, batch, device),
        "bare LightningModule": lambda: bare(copy.deepcopy(net)),
        "this template": lambda: templated([]),
    }
    if accelerator == "cpu":  # with a GPU visible the check finds it: no failed lookup to leave out
        loops["bare, no NVML check"] = lambda: bare(copy.deepcopy(net), nvml=False)
    for variant, extra in workload.get("features_off", {}).items():
        loops[variant] = lambda extra=extra: templated(extra)
    per_fit = interleaved(loops, repeats=repeats)  # each fit's first and last epochs are dropped below
    rows = {}
    for loop, fits in per_fit.items():
        kept = [t for fit in fits for t in fit[1:-1]]
        rows[loop] = summary([epoch for _, epoch in kept])
        rows[loop]["train_median"] = statistics.median(train for train, _ in kept)
        rows[loop]["epoch_end_ms"] = statistics.median(epoch - train for train, epoch in kept) * 1000
        # the fit's end, once a fit: its last epoch against the median of its own kept epochs
        ends = [fit[-1][1] - statistics.median(epoch for _, epoch in fit[1:-1]) for fit in fits]
        rows[loop]["fit_end_ms"] = statistics.median(ends) * 1000
    base, bare = rows["hand-written"], rows["bare LightningModule"]
    for loop, row in rows.items():
        row["ratio_to_hand_written"] = row["median"] / base["median"]
        row["ratio_to_bare"] = row["median"] / bare["median"]
        row["train_ratio_to_bare"] = row["train_median"] / bare["train_median"]
        print(
            f"{name:38s} {loop:38s} {row['median'] * 1000:8.1f} ms/epoch  x{row['ratio_to_bare']:.2f} bare"
            f"  (steps x{row['train_ratio_to_bare']:.2f}, after them {row['epoch_end_ms']:.1f} ms;"
            f" the fit's end {row['fit_end_ms']:.0f} ms)"
        )
    return {
        "overrides": overrides,
        "training_digits": 3500 * repeat,
        "batch_size": batch,
        "target_ratio_to_bare": TARGET_TO_BARE,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5, help="per fit; the first and the last are left out")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, for every loop alike")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="gpu: one CUDA GPU")
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be >= 3: the first and the last epoch of each fit are left out")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs a CUDA GPU, and torch sees none")
    name = "step_loop" if args.accelerator == "cpu" else "step_loop_gpu"
    # One thread: on 2 cores, two threads are stalled by anything else that runs, and the noise between rounds
    # was larger than the differences measured; the ratios are what this figure is about.
    torch.set_num_threads(args.threads)
    register()
    work = Path(tempfile.mkdtemp(prefix="bench-step-loop-"))
    results: dict[str, Any] = {
        "epochs_per_fit": args.epochs,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "accelerator": args.accelerator,
    }
    if args.accelerator == "gpu":
        results["gpu"] = torch.cuda.get_device_name()
    results["workloads"] = {
        workload: measure(workload, WORKLOADS[workload], args.epochs, args.repeats, work, args.accelerator)
        for workload in args.workloads
    }
    path = write_results(name, results)
    figure = RESULTS / f"{name}.png"
    plt = pyplot()
    widths = [max(3, len(found["rows"])) for found in results["workloads"].values()]
    fig, axes = plt.subplots(
        1, len(widths), figsize=(1.5 * sum(widths), 5), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, (workload, found) in zip(axes[0], results["workloads"].items()):
        target = ("target", found["target_ratio_to_bare"] * found["rows"]["bare LightningModule"]["median"])
        bars(found["rows"], figure, workload, "seconds per epoch (median, min-max)", target, ax=ax)
    where = results.get("gpu", "CPU")
    fig.suptitle(f"Training loop on {where}: time per epoch (train + validate), same net, batches, optimizer")
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"wrote {path} and {figure}")


if __name__ == "__main__":
    main()
