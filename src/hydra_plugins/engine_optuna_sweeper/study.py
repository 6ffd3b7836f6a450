"""Opening a study that may already hold trials of earlier runs of the same sweep, and what counts as done. A failing
storage is one line naming it and the fix (`storage_failure`), never SQLAlchemy's statement or Optuna's traceback;
mid-sweep it stops, and the same command continues the study.
"""

import contextlib
import logging
from pathlib import Path
from typing import Any, Optional

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from engine.loggers.tracking import sqlite_file

from .config import INTERRUPTED_ATTR, METRIC_ATTR, PRUNER_ATTR
from .errors import StudyUnwritable, SweeperConfigError

log = logging.getLogger(__name__)


def storage_failure(error: BaseException) -> Optional[str]:
    """What the storage said, in a few readable words, when `error` is its failure (SQLAlchemy's error, or Optuna's
    StorageInternalError around one: a full or read-only disk, a database server gone); None for any other error."""
    from engine.errors import _chain
    from engine.loggers.tracking import readable

    if isinstance(error, StudyUnwritable):  # a job's, said in its storage's words already
        return str(error)
    for e in _chain(error, causes_only=True):  # not an error raised while one was handled
        if type(e).__module__.split(".")[0] == "sqlalchemy":
            return readable(str(getattr(e, "orig", None) or e))[:200]  # the driver's words, without the statement
    if type(error).__name__ == "StorageInternalError":
        return readable(str(error))[:200]
    return None


def _make_sqlite_dir(storage: str) -> None:
    """sqlite creates the file but not its directory (logs/ in a fresh clone)."""
    path = sqlite_file(storage)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SweeperConfigError(
                f"hydra.sweeper.storage={storage}: its folder cannot be made ({e.strerror}); use a storage on "
                "a writable disk"
            ) from e


def lock(name: str, storage: Optional[str]) -> Any:
    """One sweep per study: a lock file beside an sqlite database, held for this process's life (so a killed sweep's
    RUNNING trials are known dead); a second sweep is refused. Other storages are not locked."""
    import atexit
    import fcntl
    import os
    import re

    from engine.loggers.tracking import same_file

    path = sqlite_file(storage)
    if path is None:
        return None
    _make_sqlite_dir(str(storage))
    lock_path = path.parent / f".{path.name}.{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:150]}.lock"
    while True:
        try:
            handle = open(lock_path, "a+")
        except OSError as e:
            raise SweeperConfigError(
                f"hydra.sweeper.storage={storage}: its folder is not writable ({e.strerror}); use a storage on a "
                "writable disk"
            ) from e
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise SweeperConfigError(
                f"study {name} in {storage} is being run by another sweep ({owner}); wait for it to finish, or use "
                "another hydra.sweeper.study_name"
            ) from None
        if same_file(handle, lock_path):
            break
        handle.close()  # removed by the sweep that held it, as it ended: the lock is the file there now
    try:  # straight to the file, no buffer: one that a full disk refused would be flushed again at close
        os.ftruncate(handle.fileno(), 0)
        os.write(handle.fileno(), f"pid {os.getpid()}".encode())
    except OSError as e:  # a full disk: an empty file can be made, not written
        release(handle, lock_path)
        raise SweeperConfigError(
            f"hydra.sweeper.storage={storage}: {lock_path} cannot be written ({e.strerror}); make room there, or use "
            "a storage on a writable disk"
        ) from e
    atexit.register(release, handle, lock_path)
    return handle


def release(handle: Any, lock_path: Optional[Path] = None) -> None:
    """Let go of a study's lock (`lock`), removing its file first, while it is still held: a sweep that opened it
    meanwhile finds it gone and takes the new one (no lock file is left behind)."""
    from engine.loggers.tracking import same_file

    if handle is None or handle.closed:
        return
    path = Path(lock_path or handle.name)
    with contextlib.suppress(OSError):
        if same_file(handle, path):
            path.unlink()
    with contextlib.suppress(OSError):
        handle.close()


def open_study(
    name: str, storage: Optional[str], direction: str, metric: str, sampler_cfg: Optional[DictConfig], pruner_cfg: Any
) -> Any:
    """The study `name`, created or loaded, its pruner config stored for jobs in other processes; a resumed study's
    sampler is reseeded (seed + trials so far), or a fixed seed would draw the same startup points again. A study of
    another direction or metric (a hydra.sweeper.study_name given again) is refused: its values would be compared
    with ours."""
    import optuna

    if storage:
        _make_sqlite_dir(storage)
    pruner = instantiate(pruner_cfg) if pruner_cfg else optuna.pruners.NopPruner()
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not Optuna's "Using an existing study": a refusal is 1 line
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            pruner=pruner,
            direction=optuna.study.StudyDirection[direction.upper()],
            load_if_exists=True,
        )
    except (ImportError, ValueError) as e:
        raise SweeperConfigError(f"hydra.sweeper.storage={storage}: cannot be opened ({e}); check the URL") from e
    except Exception as e:  # SQLAlchemy's errors (a read-only or full disk, a locked database), Optuna's around them
        reason = storage_failure(e)
        if reason is None and not isinstance(e, OSError):
            raise
        if reason is None or type(e).__name__ in ("ArgumentError", "NoSuchModuleError"):  # not a URL it knows
            raise SweeperConfigError(
                f"hydra.sweeper.storage={storage}: cannot be opened ({reason or e}); check the URL"
            ) from e
        raise SweeperConfigError(
            f"hydra.sweeper.storage={storage}: cannot be written ({reason}); make room there, or use a storage on "
            "a writable disk"
        ) from e
    finally:
        optuna.logging.set_verbosity(verbosity)
    found = study.direction.name.lower()
    if found != direction:
        raise SweeperConfigError(
            f"study {name} in {storage} was created with direction {found}; "
            f"use hydra.sweeper.direction={found} or another hydra.sweeper.study_name"
        )
    held = study.user_attrs.get(METRIC_ATTR, metric)  # a study of an older version: taken as ours
    if held != metric:
        raise SweeperConfigError(
            f"study {name} in {storage} holds trials of {held}, these return {metric}; use another "
            "hydra.sweeper.study_name (or monitor.metric and optimized_metric as that study had them)"
        )
    study.set_user_attr(METRIC_ATTR, metric)
    study.set_user_attr(PRUNER_ATTR, OmegaConf.to_container(pruner_cfg, resolve=True) if pruner_cfg else None)
    n_before = len(study.get_trials(deepcopy=False))
    if sampler_cfg:
        seed = sampler_cfg.get("seed")
        study.sampler = instantiate(
            OmegaConf.merge(sampler_cfg, {"seed": seed + n_before}) if seed is not None and n_before else sampler_cfg
        )
    return study


def retry_interrupted(study: Any) -> None:
    """Trials still RUNNING at start belong to a killed sweep (`lock`): marked FAIL + interrupted (not counted), and
    their parameters queued, so they run again first."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        log.warning(f"trial {trial.number} was interrupted (still RUNNING): marked FAIL, its parameters queued again")
        abandon(study, trial._trial_id, trial.params)


def abandon(study: Any, trial_id: int, params: dict[str, Any]) -> None:
    """A trial that never finished: FAIL + interrupted, and its parameters queued to run again."""
    import optuna

    trial = optuna.trial.Trial(study, trial_id)
    trial.set_user_attr(INTERRUPTED_ATTR, True)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial(params, user_attrs={"retry_of": trial.number})


def finished(study: Any) -> int:
    """Trials that count towards n_trials: COMPLETE, PRUNED and FAIL, except interrupted ones."""
    from optuna.trial import TrialState

    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if not t.user_attrs.get(INTERRUPTED_ATTR))


def save_name(path: Path, name: str, storage: Optional[str], direction: str) -> None:
    """optuna_study.yaml in the sweep dir: the study this sweep ran, where the summary's Optuna plots find it."""
    OmegaConf.save(OmegaConf.create({"study_name": name, "storage": storage, "direction": direction}), path)


def save_best(study: Any, path: Path) -> None:
    """optimization_results.yaml in the sweep dir: the study's best trial so far, over all runs."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return
    best = study.best_trial
    log.info(f"Best trial {best.number}: value {best.value}, params {best.params}")
    results = {
        "study_name": study.study_name,
        "best_trial": best.number,
        "best_value": best.value,
        "best_params": best.params,
        "output_dir": best.user_attrs.get("output_dir"),
    }
    OmegaConf.save(OmegaConf.create(results), path)


def tell(study: Any, trial: Any, value: Optional[float] = None, state: Any = None) -> None:
    """study.tell, letting samplers that end a study (GridSampler's study.stop()) say so: Optuna allows stop() only
    inside study.optimize, so mark us as its loop (private API) and keep the flag (stopped())."""
    study._thread_local.in_optimize_loop = True
    try:
        study.tell(trial, value, state=state)
    finally:
        study._thread_local.in_optimize_loop = False


def stopped(study: Any) -> bool:
    """True when the sampler has ended the study (every point of a grid tried)."""
    return bool(getattr(study, "_stop_flag", False))
