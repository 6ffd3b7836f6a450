"""Sweep jobs whose trainer launches rank processes each run as a fresh, single `train.py` run: Lightning's DDP
launcher re-runs the original argv, which in a sweep is the whole sweep, and the parent keeps LOCAL_RANK and a live
process group into the next job (Lightning #11300, hydra #2070).
"""

import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from engine.errors import UserError, say

# The script the user started (train.py), recorded by entry.cli: sweep workers may run under another argv[0].
ENTRY_SCRIPT = "PROJECT_ENTRY_SCRIPT"


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def launches_rank_scripts(trainer: Any) -> bool:
    """True when fit would re-run the script for other ranks (ddp, fsdp; not ddp_spawn, not torchrun/SLURM)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = trainer.strategy.launcher
    return (
        isinstance(launcher, _SubprocessScriptLauncher)
        and not launcher.cluster_environment.creates_processes_externally
    )


# Hydra overrides that made this process a sweep; the job's own run replaces them.
_SWEEP_ONLY = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.run.dir",
    "hydra.job.name",
    "hydra.output_subdir",
)


def remember_entry_script() -> None:
    os.environ[ENTRY_SCRIPT] = os.path.abspath(sys.argv[0])


def job_command() -> list[str]:
    """This sweep job as a single run: same config sources and overrides, writing into the job's dir."""
    hc = HydraConfig.get()
    script = os.environ.get(ENTRY_SCRIPT) or os.path.join(hc.runtime.cwd, sys.argv[0])
    cmd = [sys.executable, script, "--config-name", str(hc.job.config_name)]
    for source in hc.runtime.config_sources:
        if source.provider == "main":
            cmd += ["--config-path", source.path.removeprefix("file://")]
        elif source.provider == "command-line":
            cmd += ["--config-dir", source.path.removeprefix("file://")]
    hydra_overrides = [o for o in hc.overrides.hydra if not o.lstrip("+~").startswith(_SWEEP_ONLY)]
    run_dir = str(hc.runtime.output_dir).replace("\\", "\\\\").replace('"', '\\"')
    return cmd + [
        *hc.overrides.task,
        *hydra_overrides,
        f'hydra.run.dir="{run_dir}"',  # quoted: a comma in the path would otherwise read as a sweep
        "hydra.output_subdir=null",  # the sweep already saved this job's .hydra/
        f"hydra.job.name={hc.job.name}",
    ]


def objective(metrics: dict[str, float], name: str | None) -> float | None:
    """The number handed to the sweeper. In a sweep a metric that was never logged is an error, not None:
    an optimizing sweeper would otherwise compare nothing."""
    if not name:
        return None
    if name not in metrics and is_multirun():
        raise UserError(f"optimized_metric={name} was not logged; logged: {', '.join(sorted(metrics)) or 'nothing'}")
    return metrics.get(name)


def run_job_in_fresh_process(optimized_metric: str | None) -> float | None:
    """Run this job as its own process; return its `optimized_metric` for the sweeper."""
    import importlib  # the plugin by name, as engine.sweeps.pruning imports it

    out_of_reach = importlib.import_module("hydra_plugins.engine_optuna_sweeper.job").pruner_out_of_reach()
    if out_of_reach:
        raise UserError(out_of_reach)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    # The job seeds itself from its own config: an earlier job's seed must not reach it through the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    proc = subprocess.run(job_command(), cwd=hc.runtime.cwd, env=env)
    if proc.returncode != 0:
        raise UserError(f"its processes exited with code {proc.returncode}; their error is printed above")
    from engine.runs.results import read_metrics

    return objective(read_metrics(run_dir), optimized_metric)


ERROR_FILE = "error.txt"


def record_failure(job_dir: Path, line: str) -> None:
    """A failed sweep job: its one-line error on stderr, and with the traceback in <job>/error.txt, where
    SweepReport and the sweep summary find it whatever launcher ran the job."""
    hc = HydraConfig.get()
    say(f"error: sweep job {hc.job.num} ({' '.join(hc.overrides.task)}): {line}")
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / ERROR_FILE).write_text(f"{line}\n\n{traceback.format_exc()}")


class SweepReport(Callback):
    """At the end of a sweep: every failed job in one line each, and a non-zero exit if any failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        failed = sorted(sweep_dir.glob(f"*/{ERROR_FILE}"), key=lambda p: (len(p.parent.name), p.parent.name))
        if not failed:
            return
        jobs = sum(1 for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir())
        for path in failed:
            print(f"error: sweep job {path.parent.name}: {path.read_text().splitlines()[0]}", file=sys.stderr)
        print(f"error: {len(failed)} of {jobs} sweep jobs failed; see {sweep_dir}/<job>/{ERROR_FILE}", file=sys.stderr)
        raise SystemExit(2)  # an exception would become a warning: Hydra's callbacks catch them
