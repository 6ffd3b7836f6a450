"""Sweep jobs whose trainer launches rank processes each run as a fresh, single `train.py` run: Lightning's DDP
launcher re-runs the original argv, which in a sweep is the whole sweep, and the parent keeps LOCAL_RANK and a live
process group into the next job (Lightning #11300, hydra #2070).
"""

import math
import os
import re
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
    """The number handed to the sweeper. In a sweep a metric that was never logged, or is NaN or infinite, is an
    error, not None or NaN: an optimizing sweeper would otherwise compare nothing (a NaN row ranked as "ok")."""
    if not name:
        return None
    value = metrics.get(name)
    if not is_multirun():
        return value
    if value is None:
        raise UserError(_missing(metrics, name))
    if not math.isfinite(value):
        raise UserError(
            f"optimized_metric={name} is {value}, not a number a sweep can rank: the run diverged or the metric is "
            "broken; this job counts as failed (a lower learning rate, or gradient clipping, may keep it finite)"
        )
    return value


def _missing(metrics: dict[str, float], name: str) -> str:
    """Why `name` has no value: the metric it is the best of was logged only as NaN/inf, or never logged."""
    base = name.removeprefix("best/").removesuffix("_best")
    if base != name and base in metrics and not math.isfinite(metrics[base]):
        return (
            f"optimized_metric={name} has no value: {base} was logged, but never as a finite number (last: "
            f"{metrics[base]}), so it has no best; the run diverged or the metric is broken, and this job counts as "
            "failed"
        )
    return f"optimized_metric={name} was not logged; logged: {', '.join(sorted(metrics)) or 'nothing'}"


def _written_metrics(run_dir: Path) -> dict[str, float]:
    """A run's metrics files as read_metrics reads them, but a metric written as null (non-finite) kept as NaN."""
    import json

    metrics: dict[str, float] = {}
    for name in ("fit_metrics.json", "test_metrics.json"):
        try:
            found = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict):
            metrics.update(
                {k: math.nan if v is None else float(v) for k, v in found.items() if v is None or _is_number(v)}
            )
    return metrics


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    logs_before = _log_sizes(run_dir)
    proc = subprocess.run(job_command(), cwd=hc.runtime.cwd, env=env)
    if proc.returncode != 0:
        raise UserError(
            f"its processes exited with code {proc.returncode}: {_ranks_error(run_dir, hc.job.name, logs_before)}"
        )
    return objective(_written_metrics(run_dir), optimized_metric)


_ERROR_LINE = re.compile(r"\]\[ERROR\] - (?:error: )?(.+)$")


def _log_sizes(run_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in run_dir.glob("*.log")}


def _ranks_error(run_dir: Path, job_name: str, before: dict[Path, int]) -> str:
    """The first error line the job's ranks logged (rank 0's log first, whose line names the rank that failed),
    read from what they added to <job>/*.log: their stderr went to the console only, so error.txt and the summary
    would otherwise hold no reason."""
    main = run_dir / f"{job_name}.log"
    for path in sorted(run_dir.glob("*.log"), key=lambda p: (p != main, p.name)):
        try:
            with path.open("rb") as log:
                log.seek(before.get(path, 0))
                added = log.read().decode(errors="replace")
        except OSError:
            continue
        for line in added.splitlines():
            found = _ERROR_LINE.search(line)
            if found:
                return found.group(1) + ("" if path == main else f" (in {path})")
    logs = ", ".join(str(p) for p in sorted(run_dir.glob("*.log"))) or "none written"
    return f"no error line in the ranks' logs ({logs}); the console output above says why"


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
