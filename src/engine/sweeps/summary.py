"""One table and one figure per sweep: every job's overrides, status, metrics, epochs and wall time. It reads what
each job left in its directory, so it works for any sweeper and launcher, and a failed job is a row, never a crash.
"""

import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from engine.runs.results import read_metrics
from engine.sweeps import objective
from engine.sweeps.jobs import ERROR_FILE

PRUNED_FILE = "pruned.json"  # written by engine.sweeps.pruning when Optuna stopped the job
COLUMNS = ["job", "status", "metric", "test", "epochs", "wall_s", "overrides", "error"]


@dataclass
class Job:
    """One row: what a job directory says about its job."""

    name: str
    overrides: dict[str, str]
    status: str  # ok | failed | pruned | interrupted (by a signal: resumable) | unfinished (killed, or running)
    # | not started (a basic sweep's job whose directory is not there: the sweep was killed, or is still running)
    metric: float | None = None
    test: float | None = None
    epochs: int | None = None
    wall_s: float | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _as_dict(overrides: list[str]) -> dict[str, str]:
    """`key=value` overrides (`+key=`, `~key`) as {key: value}."""
    pairs = (line.lstrip("+~").partition("=") for line in overrides)
    return {key: value for key, _, value in pairs}


def _overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    return _as_dict((yaml.safe_load(path.read_text()) if path.is_file() else None) or [])


def _epochs(job_dir: Path) -> int | None:
    """Epochs trained whole, as last.ckpt says (rewritten after every epoch; an interrupted job's may be from within
    one)."""
    last = job_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return None
    try:
        from engine.runs import checkpoints
        from engine.runs.resume import epochs_trained

        return epochs_trained(checkpoints.load(last, mmap=True))  # a file, or fsdp's folder of shards (its meta.pt)
    except Exception:  # a torn or foreign file: the row says "?" rather than the summary failing
        return None


def _wall_s(job_dir: Path) -> float | None:
    """From the job's saved config (written as it starts) to its newest file."""
    start = job_dir / ".hydra" / "config.yaml"
    if not start.is_file():
        return None
    newest = max(p.stat().st_mtime for p in job_dir.rglob("*") if p.is_file())
    return round(newest - start.stat().st_mtime, 1)


def test_metric_for(metric: str) -> str:
    """The test counterpart of the optimized metric, named as the validation one is: best/val/acc (or val/acc_best)
    -> test/acc, val_rmse -> test_rmse, valid/r2 -> test/r2; a name without a val prefix: test/<its last part>."""
    name = metric.removeprefix("best/").removesuffix("_best")
    test, found = re.subn(r"^(val|valid|validation)(?=[/_.-])", "test", name)
    return test if found else "test/" + name.split("/")[-1]


def read_job(job_dir: Path, metric: str) -> Job:
    metrics = read_metrics(job_dir)
    job = Job(job_dir.name, _overrides(job_dir), "unfinished", epochs=_epochs(job_dir), wall_s=_wall_s(job_dir))
    job.metric, job.test = metrics.get(metric), metrics.get(test_metric_for(metric))
    if (job_dir / ERROR_FILE).is_file():
        lines = (job_dir / ERROR_FILE).read_text().splitlines()
        job.status, job.error = "failed", lines[0] if lines else "(empty error.txt)"
    elif (job_dir / PRUNED_FILE).is_file():
        job.status = "pruned"
    elif "interrupted" in _statuses(job_dir):  # stopped by a signal, with its metrics so far
        job.status = "interrupted"
    elif metrics and not _test_missing(job_dir):  # killed during its test: unfinished
        job.status = "ok"
    return job


def _test_missing(job_dir: Path) -> bool:
    """The job's config asked for a test after training (`test: true`) and the test wrote no metrics."""
    config = job_dir / ".hydra" / "config.yaml"
    try:
        cfg = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):  # no saved config (hydra.output_subdir=null): nothing said
        return False
    asked = isinstance(cfg, dict) and cfg.get("test") is True and cfg.get("train", True) is True
    return asked and not (job_dir / "test_metrics.json").is_file()


def _statuses(job_dir: Path) -> set[str]:
    """How the job's fit and test ended, as their metrics files say (engine.runs.results)."""
    found = set()
    for name in ("fit_metrics.json", "test_metrics.json"):
        try:
            found.add(str(json.loads((job_dir / name).read_text()).get("status")))
        except (OSError, ValueError, AttributeError):  # absent, torn or not an object: nothing said
            pass
    return found


def _sweep_settings(sweep_dir: Path) -> tuple[str, bool]:
    """(optimized metric, higher is better) from the sweep's config (engine.sweeps.objective): optimized_metric, else
    the best monitor.metric, sorted by monitor.mode. A sweep dir without it (or an old sweep's metric of another
    direction): by the metric's name."""
    path = sweep_dir / "multirun.yaml"
    cfg = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
    select = lambda key: OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)  # noqa: E731
    metric, monitor, mode = objective.metric(cfg), select("monitor.metric"), select("monitor.mode")
    if mode in ("max", "min") and metric in objective.forms(str(monitor)):
        return metric, mode == "max"
    return metric, not any(word in metric for word in ("loss", "error", "mse", "mae"))


def _planned(sweep_dir: Path) -> dict[str, dict[str, str]]:
    """The jobs a basic sweep planned (multirun.yaml, expanded as Hydra's basic sweeper does), by directory name, with
    their overrides; empty for other sweepers, other job-dir names, or what cannot be expanded here."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return {}
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = yaml.safe_load(path.read_text())["hydra"]  # as written: the job dirs' name unresolved
        if hydra["sweeper"]["_target_"] != f"{BasicSweeper.__module__}.BasicSweeper":
            return {}
        if hydra["sweep"]["subdir"] != "${hydra.job.num}":
            return {}
        params = [f"{key}={value}" for key, value in (hydra["sweeper"].get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *hydra["overrides"]["task"]])
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # e.g. a sweep over globs of config files needs Hydra's config loader: its rows stay as found
        return {}
    jobs = [job for batch in batches for job in batch]
    return {str(num): _as_dict(job) for num, job in enumerate(jobs)}


def read_sweep(sweep_dir: Path) -> tuple[list[Job], str]:
    """Every job of the sweep, best first; then the jobs whose metric is partial (interrupted), then those without
    one (failed, unfinished), then a basic sweep's jobs that never started."""
    metric, higher_better = _sweep_settings(sweep_dir)
    planned = _planned(sweep_dir)
    # a job's folder: with .hydra/, or named as a planned job (hydra.output_subdir=null, or a job just starting)
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / ".hydra").is_dir() or p.name in planned)]
    jobs = [read_job(p, metric) for p in sorted(dirs, key=lambda p: (len(p.name), p.name))]
    for job in jobs:
        job.overrides = job.overrides or planned.get(job.name, {})
    started = {job.name for job in jobs}
    jobs += [Job(name, overrides, "not started") for name, overrides in planned.items() if name not in started]
    sign = -1 if higher_better else 1
    never = lambda j: j.status == "not started"  # noqa: E731
    jobs.sort(key=lambda j: (never(j), j.metric is None, j.status == "interrupted", sign * (j.metric or 0.0)))
    return jobs, metric


def swept_keys(jobs: list[Job]) -> list[str]:
    """Overrides whose value differs between jobs: the parameters of the sweep."""
    keys = dict.fromkeys(k for job in jobs for k in job.overrides)
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def _fmt(value: Any, short: bool = True) -> str:
    """4 significant figures for people (summary.md); every digit for scripts (summary.csv)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if short else repr(value)
    return str(value)


def _rows(jobs: list[Job], short: bool = True) -> list[list[str]]:
    return [
        [
            job.name,
            job.status,
            _fmt(job.metric, short),
            _fmt(job.test, short),
            _fmt(job.epochs),
            _fmt(job.wall_s, short),
            " ".join(f"{k}={v}" for k, v in job.overrides.items()),
            job.error,
        ]
        for job in jobs
    ]


def to_csv(jobs: list[Job], metric: str) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([metric if c == "metric" else test_metric_for(metric) if c == "test" else c for c in COLUMNS])
    writer.writerows(_rows(jobs, short=False))
    return out.getvalue()


def to_markdown(jobs: list[Job], metric: str, sweep_dir: Path) -> str:
    header = [metric if c == "metric" else test_metric_for(metric) if c == "test" else c for c in COLUMNS]
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    statuses = ("ok", "pruned", "failed", "interrupted", "unfinished", "not started")
    counts = {s: sum(j.status == s for j in jobs) for s in statuses}
    lines = [
        f"# Sweep {sweep_dir}",
        "",
        f"{len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; sorted by {metric}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cell(c) for c in row) + " |" for row in _rows(jobs)),
    ]
    return "\n".join(lines) + "\n"


def _as_number(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def plot(jobs: list[Job], metric: str, path: Path) -> None:
    """One panel per swept parameter: the metric of every job that has one against that parameter's value."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    keys = swept_keys(jobs) or ["job"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [job.name if key == "job" else job.overrides.get(key, "") for job in jobs]
        numbers = [_as_number(v) for v in values]
        numeric = all(n is not None for n in numbers)
        labels = sorted(set(values), key=lambda v: (_as_number(v) is None, _as_number(v) or 0.0, v))
        for status, marker in (("ok", "o"), ("pruned", "x")):
            points = [
                (numbers[i] if numeric else labels.index(values[i]), job.metric)
                for i, job in enumerate(jobs)
                if job.status == status and job.metric is not None
            ]
            if points:
                ax.scatter(*zip(*points), marker=marker, label=status)
        positive = [n for n in numbers if n is not None and n > 0]
        if numeric and len(positive) == len(numbers) and max(positive) / min(positive) >= 20:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    failed = sum(job.metric is None or job.status not in ("ok", "pruned") for job in jobs)
    title = f"{metric} by swept parameter" + (
        f" ({failed} jobs not shown: failed, interrupted, unfinished or not started)" if failed else ""
    )
    fig.suptitle(title, fontsize=10)
    if any(job.status == "pruned" and job.metric is not None for job in jobs):
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def optuna_plots(sweep_dir: Path) -> str:
    """Optuna's own plots beside summary.png, for a sweep dir that names its Optuna study (optuna_study.yaml, left
    by our Optuna sweeper), and the section of summary.md that lists them; "" for any other sweep."""
    if not (sweep_dir / "optuna_study.yaml").is_file():
        return ""
    import importlib  # the plugin by name, as engine.sweeps.pruning imports it (mypy sees src/ by path)

    return importlib.import_module("hydra_plugins.engine_optuna_sweeper.plots").write(sweep_dir)


def write_summary(sweep_dir: Path) -> list[Job]:
    """summary.csv, summary.md and summary.png in `sweep_dir` (and an Optuna sweep's plots); returns the rows."""
    jobs, metric = read_sweep(sweep_dir)
    (sweep_dir / "summary.csv").write_text(to_csv(jobs, metric))
    (sweep_dir / "summary.md").write_text(to_markdown(jobs, metric, sweep_dir) + optuna_plots(sweep_dir))
    if jobs:
        plot(jobs, metric, sweep_dir / "summary.png")
    from engine.sweeps import mlflow_runs as mlflow_sweep  # the summary on the sweep's MLflow parent run, if it has one

    mlflow_sweep.log_summary(sweep_dir)
    return jobs


class SweepSummary(Callback):
    """Writes the summary when a multirun ends. Registered after SweepReport in conf/hydra/default.yaml:
    on_multirun_end callbacks run in reverse order, so the summary exists before SweepReport exits non-zero.
    At the start, refuses a sweep whose jobs it would rank by another metric's direction (engine.sweeps.objective),
    whatever the sweeper: before any job, study or file (Hydra turns a callback's exceptions into warnings, so it
    exits here)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from engine.errors import exit_with
        from engine.runs.dirs import remove_if_unused

        refused = objective.refusal(config)
        if refused is not None:
            remove_if_unused(Path(str(OmegaConf.select(config, "hydra.sweep.dir"))))  # RunDirGuard made it
            exit_with(refused)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        if not sweep_dir.is_dir():
            return
        try:
            write_summary(sweep_dir)
        except Exception as e:  # the summary is a report: it must not hide the sweep's own result
            print(f"error: sweep summary of {sweep_dir} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        print(f"Sweep summary: {sweep_dir / 'summary.md'}")


def main(argv: list[str]) -> int:
    """python -m engine.sweeps.summary <sweep dir>: (re)write the summary of an existing sweep."""
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "error: usage: python -m engine.sweeps.summary <sweep dir> (logs/train/multiruns/<time>)", file=sys.stderr
        )
        return 2
    sweep_dir = Path(argv[0])
    if not any((p / ".hydra").is_dir() for p in sweep_dir.iterdir()):
        print(f"error: {sweep_dir}: no sweep jobs in it (directories with .hydra/)", file=sys.stderr)
        return 2
    write_summary(sweep_dir)
    print((sweep_dir / "summary.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
