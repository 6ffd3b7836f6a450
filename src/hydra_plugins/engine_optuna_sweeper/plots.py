"""Optuna's own plots of a sweep's study, beside the sweep summary's summary.png: optimization history, parameter
importances, intermediate values (the per-epoch values the pruner judged). Drawn by engine.sweeps.summary for a
sweep dir that names its study (optuna_study.yaml, written by the sweeper). They show the whole study, every run of
the same search; a plot that cannot be drawn is a line in summary.md saying why, never a failed summary."""

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from .config import STUDY_FILE

MIN_IMPORTANCE_TRIALS = 2  # completed trials Optuna's importance evaluators need (with fewer, all are 0)


class NotDrawn(Exception):
    """Why a plot was not drawn: one line for summary.md."""


def _study(sweep_dir: Path) -> Any:
    """The sweep's study: from its storage, or the sweeper's own in-memory study while the sweep's process lives."""
    import optuna

    from . import optuna_sweeper

    info = OmegaConf.load(sweep_dir / STUDY_FILE)
    name, storage = str(info.study_name), info.storage
    if not storage:
        active = optuna_sweeper.ACTIVE_STUDY
        if active is not None and active.study_name == name:
            return active
        raise NotDrawn(f"study {name} was kept in memory (hydra.sweeper.storage=null) and ended with its sweep")
    from engine.loggers.tracking import sqlite_file

    database = sqlite_file(str(storage))
    if database is not None and not database.is_file():  # opening it would create an empty database
        raise NotDrawn(f"{database} does not exist any more")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=name, storage=str(storage))
    except Exception as e:  # a database that is gone, or holds no such study
        raise NotDrawn(f"study {name} cannot be read from {storage}: {type(e).__name__}: {e}") from e


def _history(study: Any, path: Path) -> str:
    import numpy as np
    from optuna.trial import TrialState
    from optuna.visualization.matplotlib import plot_optimization_history

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise NotDrawn("no trial has completed yet")
    ax = plot_optimization_history(study)
    points = np.asarray(ax.collections[0].get_offsets()) if ax.collections else np.zeros((0, 2))
    numbers = [int(x) for x in points[:, 0]]  # what the figure shows, read back from it
    _save(ax, path)
    return f"the objective of the {len(numbers)} completed trials ({', '.join(map(str, numbers))}) and the best so far"


def _importances(study: Any, path: Path) -> str:
    import optuna
    from optuna.trial import TrialState
    from optuna.visualization.matplotlib import plot_param_importances

    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    # every trial's: the space is the search's, not the completed trials' (none, after an interrupted first one)
    searched = sorted({name for trial in study.get_trials(deepcopy=False) for name in trial.distributions})
    if len(searched) < 2:
        raise NotDrawn(f"needs at least 2 searched parameters, this search has {len(searched)}")
    if len(completed) < MIN_IMPORTANCE_TRIALS:
        raise NotDrawn(f"needs at least {MIN_IMPORTANCE_TRIALS} completed trials, the study has {len(completed)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importances = optuna.importance.get_param_importances(study)
    said = [str(w.message) for w in caught if "importances will be equal" in str(w.message).lower()]
    if said or not any(importances.values()):
        raise NotDrawn(f"too few completed trials ({len(completed)}) to tell the parameters apart: {' '.join(said)}")
    _save(plot_param_importances(study), path)
    ranked = ", ".join(f"{name} {value:.2f}" for name, value in importances.items())
    return f"how much each parameter decides the objective, from {len(completed)} completed trials: {ranked}"


def _intermediate(study: Any, path: Path) -> str:
    from optuna.visualization.matplotlib import plot_intermediate_values

    if not any(trial.intermediate_values for trial in study.get_trials(deepcopy=False)):
        raise NotDrawn("no trial reported per-epoch values (callbacks.optuna_pruning reports monitor.metric)")
    ax = plot_intermediate_values(study)
    numbers = [str(line.get_label()).removeprefix("Trial") for line in ax.lines]  # read back from the figure
    _save(ax, path)
    return f"the per-epoch value the pruner judged, for trials {', '.join(numbers)}"


def _save(ax: Any, path: Path) -> None:
    ax.figure.savefig(path, dpi=100, bbox_inches="tight")


PLOTS: dict[str, Callable[[Any, Path], str]] = {
    "optuna_history.png": _history,
    "optuna_importances.png": _importances,
    "optuna_intermediate.png": _intermediate,
}


def write(sweep_dir: Path) -> str:
    """Draw the plots into `sweep_dir`; returns the section of summary.md that lists them (or says why not)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt
    import optuna

    lines = ["", "## Optuna's plots", ""]
    study: Optional[Any] = None
    try:
        study = _study(sweep_dir)
    except Exception as e:  # NotDrawn, or a torn optuna_study.yaml: the summary says so and goes on
        lines.append(f"Not drawn: {e if isinstance(e, NotDrawn) else f'{type(e).__name__}: {e}'}.")
    if study is not None:
        n = len(study.get_trials(deepcopy=False))
        lines += [f"Of study `{study.study_name}`, all {n} trials of every run of this search:", ""]
    for name, draw in PLOTS.items():
        (sweep_dir / name).unlink(missing_ok=True)  # a plot of an earlier summary must not pass for this one's
        if study is None:
            continue
        try:
            with matplotlib.rc_context(), warnings.catch_warnings():  # Optuna switches the style to ggplot
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                lines.append(f"- [{name}]({name}): {draw(study, sweep_dir / name)}")
        except NotDrawn as e:
            lines.append(f"- {name}: not drawn: {e}")
        except Exception as e:  # a report: one plot Optuna cannot draw must not cost the others or the summary
            lines.append(f"- {name}: not drawn: {type(e).__name__}: {' '.join(str(e).split())}")
        finally:
            plt.close("all")
    return "\n".join(lines) + "\n"
