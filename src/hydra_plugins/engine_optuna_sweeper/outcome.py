"""How a finished job becomes its trial's state: COMPLETE with its value, PRUNED, or FAIL with a one-line error.
Every FAIL leaves `<job dir>/error.txt` and one `error:` line, as a basic sweep's failed job does; the sweep goes on,
and the non-zero exit at its end is SweepReport's.
"""

import logging
import math
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

from hydra.core.utils import JobReturn, JobStatus

from engine.errors import SweepStopped
from engine.sweeps.jobs import ERROR_FILE

from .config import ERROR_ATTR, PRUNED_ATTR
from .study import tell

log = logging.getLogger(__name__)
_JOB_LOG_FORMAT = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")  # Hydra's, in job logs


def _number(value: Any) -> Optional[float]:
    """A finite number, else None: a NaN or infinite objective is a failed trial, never a value to compare."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _fail(job_dir: Optional[Path], trial_number: int, line: str, details: str = "") -> str:
    """Record a failure the job did not record itself (its own error.txt is kept): on stderr, in error.txt, and at the
    end of the job's log (`<task>.log`), as engine.errors.say would."""
    if job_dir is not None and (job_dir / ERROR_FILE).is_file():
        return (job_dir / ERROR_FILE).read_text().splitlines()[0]
    said = f"error: sweep job {trial_number}: {line}"
    print(said, file=sys.stderr)
    if job_dir is not None:
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / ERROR_FILE).write_text(f"{line}\n\n{details}")
        record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, said, None, None)
        for job_log in job_dir.glob("*.log"):  # none when the job never started
            with job_log.open("a") as out:
                out.write(_JOB_LOG_FORMAT.format(record) + "\n")
    return line


def record(study: Any, trial: Any, ret: JobReturn, job_dir: Optional[Path]) -> str:
    """Tell the study how `trial` ended; returns its state's name."""
    import optuna
    from optuna.trial import TrialState

    stored = study._storage.get_trial(trial._trial_id)  # the job may have written to it from another process
    error = ret._return_value if ret.status == JobStatus.FAILED else None
    if isinstance(error, SweepStopped):
        raise error  # the sweeper says it
    if PRUNED_ATTR in stored.user_attrs or isinstance(error, optuna.TrialPruned):
        tell(study, trial, state=TrialState.PRUNED)
        log.info(f"trial {trial.number} pruned at step {stored.user_attrs.get(PRUNED_ATTR, stored.last_step)}")
        return "PRUNED"
    value = _number(ret.return_value) if error is None else None
    if value is not None:
        tell(study, trial, value)
        log.info(f"trial {trial.number}: {value} {trial.params}")
        return "COMPLETE"
    if error is not None:
        line = f"{type(error).__name__}: {' '.join(str(error).split())}"
        details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    else:
        line = f"returned {ret.return_value!r}, not a finite number (is optimized_metric set, logged and finite?)"
        details = ""
    trial.set_user_attr(ERROR_ATTR, _fail(job_dir, trial.number, line, details))
    tell(study, trial, state=TrialState.FAIL)
    log.info(f"trial {trial.number} failed")
    return "FAIL"
