"""Config mistakes of the sweeper: the project's UserError, so `train.py` prints them as one line, exit code 2."""

from engine.errors import SweepStopped, UserError


class SweeperConfigError(UserError):
    """A mistake in hydra.sweeper or in the search space."""


class StudyUnwritable(SweepStopped):
    """A job could not write to the study's storage (a report to the pruner): the sweep stops, and says why once."""
