"""Inside a sweep job: the Optuna trial this job runs, to report intermediate values and ask whether to stop."""

import os
from typing import Any, Optional

from .config import PRUNED_ATTR, PRUNER_ATTR, STORAGE_ENV, STUDY_ENV, TRIAL_ID_ENV


def current_trial() -> Optional[Any]:
    """This job's optuna.trial.Trial, or None outside an Optuna sweep (a single run, another sweeper).

    With a storage the study is loaded from it (name and URL from the environment, the pruner from the study's
    user attrs), so this works in any process a launcher runs the job in, and in processes the job starts;
    without a storage only for jobs run in the sweeper's own process (the basic launcher)."""
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


def report(trial: Any, value: float, step: int) -> bool:
    """Report an intermediate value; True when the pruner says stop. The trial is then marked pruned in
    storage, so the sweeper sees it even when no exception can travel back (a subprocess, a finished job). A storage
    that cannot be written stops the sweep, which says so once (not this job as a failure of its own too)."""
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
