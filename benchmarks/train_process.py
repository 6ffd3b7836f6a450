"""A real `python train.py ...` process with benchmarks/epoch_timer.py added: per-epoch times from inside the run,
start-up and imports left out (figures 5 and 6 measure epochs, not processes)."""

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from timing import REPO, checked, python_env, run_process


def timed_epochs(overrides: list[str], threads: int | None = None) -> list[dict[str, Any]]:
    """Runs train.py with `overrides` in a fresh folder; returns rank 0's epochs (train_s, epoch_s, samples).
    `threads`: OMP_NUM_THREADS for the run (and so for its ranks); None leaves torch's choice."""
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    timer = [
        "+callbacks.epoch_timer._target_=epoch_timer.EpochTimer",
        f"+callbacks.epoch_timer.path={work / 'epochs.json'}",
    ]
    env = python_env(**({"OMP_NUM_THREADS": str(threads)} if threads is not None else {}))
    cmd = [sys.executable, str(REPO / "train.py"), *overrides, *timer]
    checked(run_process(cmd, cwd=work, env=env), " ".join(cmd))
    return json.loads((work / "epochs.json").read_text())["epochs"]
