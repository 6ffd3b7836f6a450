"""`make bench`: what the engine's `speedups` switch (conf: `speedups: true`) is worth, shortcut by shortcut.

The switch turns on four shortcuts through Lightning's per-step bookkeeping and one through the interpreter's exit
(engine.build, engine.entry; each fenced by tests/test_private_api.py):
- self.log skips Lightning's move of its result object to the device it is already on (engine.loggers.logged_values);
- hooks a callback does not override are not dispatched, and no profiler context is entered per hook call when no
  profiler was asked for (engine.callbacks.dispatch);
- without a visible GPU, torch answers "is CUDA available?" from its cached device count, not from NVML on every
  optimizer step (engine.launch.devices);
- the process exits without tearing down every module torch and Lightning loaded (engine.entry._leave).

Workload: the template's classifier on the 784-64-128-64 MLP, the default digits' training split repeated 4 times
(14,000 digits, batch 64), one thread, as `python train.py model=mlp` runs it; each configuration is the template
with one shortcut off, in interleaved rounds. The figure per configuration is the fastest training epoch over all
rounds (the machines here share their cores: a slower epoch is another tenant's, not ours), the first epoch of each
fit left out. The exit: `python train.py` under the tiny profile, whole process, with and without the switch.
Writes benchmarks/results/speedups.json. Keep a shortcut only while it is worth 5% or more of an epoch.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector import result as lightning_result
from omegaconf import OmegaConf
from step_loop import MLP, compose_cfg, template
from timing import REPO, interleaved, run_process, summary, write_results

import engine.build
import engine.callbacks.dispatch as dispatch
import engine.launch.devices as devices
import engine.loggers.logged_values as logged_values
from engine.config import register

SHORTCUTS = ("self.log move", "hook dispatch", "NVML check")
ORIGINAL = {
    "to": logged_values._lightnings_to,
    "hooks": dispatch.skip_unused_hooks,
    "moves": logged_values.skip_needless_moves,
    "nvml": devices.answer_cuda_checks_without_nvml,
    "profiler": engine.build._profiler,
}


def with_shortcuts(on: set[str]) -> None:
    """The process as engine.build leaves it with only the shortcuts in `on` (each off restores Lightning's own)."""
    lightning_result._ResultMetric.to = ORIGINAL["to"]  # type: ignore[method-assign]
    dispatch.skip_unused_hooks = ORIGINAL["hooks"] if "hook dispatch" in on else (lambda callbacks: None)
    engine.build._profiler = ORIGINAL["profiler"] if "hook dispatch" in on else (lambda cfg: {})
    logged_values.skip_needless_moves = ORIGINAL["moves"] if "self.log move" in on else (lambda: None)
    devices.answer_cuda_checks_without_nvml = ORIGINAL["nvml"] if "NVML check" in on else (lambda: None)


def epochs(on: set[str], repeat: int, n_epochs: int) -> list[float]:
    with_shortcuts(on)
    with tempfile.TemporaryDirectory() as folder:
        cfg = compose_cfg(MLP, Path(folder), n_epochs)
        OmegaConf.set_struct(cfg, False)
        cfg.data = OmegaConf.create({"_target_": "repeated_digits.RepeatedDigits", "repeat": repeat, "batch_size": 64})
        return [train_s for train_s, _ in template(cfg)[1:]]


def exit_cost(speedups: bool) -> float:
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PROJECT_PROFILE": "tiny", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(REPO / "train.py"), "model=mlp", "test=false", f"speedups={str(speedups).lower()}"]
        return run_process(cmd, cwd=Path(folder), env=env).wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="rounds (one fit of each configuration per round)")
    parser.add_argument("--repeat", type=int, default=4, help="times the training split is repeated in an epoch")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    register()
    torch.set_num_threads(1)
    configs: dict[str, Any] = {"all on": lambda: epochs(set(SHORTCUTS), args.repeat, args.epochs)}
    for name in SHORTCUTS:
        configs[f"{name} off"] = lambda name=name: epochs(set(SHORTCUTS) - {name}, args.repeat, args.epochs)
    configs["all off"] = lambda: epochs(set(), args.repeat, args.epochs)
    fastest = {name: min(e for fit in fits for e in fit) for name, fits in interleaved(configs, args.repeats).items()}
    rows: dict[str, Any] = {
        name: {"fastest_epoch_s": value, "ratio_to_all_on": value / fastest["all on"]}
        for name, value in fastest.items()
    }
    processes = interleaved({"speedups=true": lambda: exit_cost(True), "speedups=false": lambda: exit_cost(False)}, 3)
    rows["whole process, tiny profile"] = {name: summary(samples) for name, samples in processes.items()}
    write_results(
        "speedups",
        {
            "workload": f"MLP 784-64-128-64, {3500 * args.repeat} training digits, batch 64, 1 thread",
            "rows": rows,
        },
    )
    for name, row in rows.items():
        shown = f"{row['fastest_epoch_s']:.3f} s, x{row['ratio_to_all_on']:.3f}" if "ratio_to_all_on" in row else row
        print(name, shown)


if __name__ == "__main__":
    main()
