"""Inside a sweep job: the Optuna trial this job runs, to report intermediate values and ask whether to stop."""

import os
from typing import Any, Optional

from .config import PRUNED_ATTR, PRUNER_ATTR, STORAGE_ENV, STUDY_ENV, TRIAL_ID_ENV


def current_trial() -> Optional[Any]:
    """This job's optuna.trial.Trial, or None outside an Optuna sweep. Loaded from the storage, so any process works;
    without a storage, only jobs in the sweeper's own process (the basic launcher)."""
    trial_id = os.environ.get(TRIAL_ID_ENV)
    if not trial_id:
        return None
    import optuna

    from . import optuna_sweeper

    if os.environ.get(STORAGE_ENV):
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "Using an existing study" per job
        study = optuna.load_study(study_name=os.environ[STUDY_ENV], storage=os.environ[STORAGE_ENV])
        pruner = study.user_attrs.get(PRUNER_ATTR)
        if pruner:
            from hydra.utils import instantiate

            study.pruner = instantiate(pruner)
    elif optuna_sweeper.ACTIVE_STUDY is not None and optuna_sweeper.ACTIVE_STUDY.study_name == os.environ.get(
        STUDY_ENV
    ):
        study = optuna_sweeper.ACTIVE_STUDY
    else:
        return None
    return optuna.trial.Trial(study, int(trial_id))


def pruner_out_of_reach() -> Optional[str]:
    """Why a process this job starts (its ranks, engine.sweeps.jobs) could not report to its trial, or None: the study
    is kept in memory, in this process, and has a pruner that would never judge it."""
    if not os.environ.get(TRIAL_ID_ENV) or os.environ.get(STORAGE_ENV):
        return None
    import optuna

    from . import optuna_sweeper

    study = optuna_sweeper.ACTIVE_STUDY
    if study is None or isinstance(study.pruner, optuna.pruners.NopPruner):
        return None
    return (
        "its ranks run in processes of their own, which cannot reach a study kept in memory "
        "(hydra.sweeper.storage=null): no trial would be pruned; set hydra.sweeper.storage=sqlite:///<path>.db "
        "(or hydra.sweeper.pruner=null)"
    )


def report(trial: Any, value: float, step: int) -> bool:
    """Report an intermediate value; True when the pruner says stop, the trial then marked pruned in storage (no
    exception may travel back). An unwritable storage stops the sweep, which says so once."""
    from .errors import StudyUnwritable
    from .study import storage_failure

    try:
        trial.report(value, step)
        if not trial.should_prune():
            return False
        trial.set_user_attr(PRUNED_ATTR, step)
    except Exception as e:
        reason = storage_failure(e)
        if reason is None:
            raise
        raise StudyUnwritable(reason) from e
    return True
