"""Config mistakes of the sweeper: the project's UserError, so `train.py` prints them as one line, exit code 2."""

from engine.errors import UserError


class SweeperConfigError(UserError):
    """A mistake in hydra.sweeper or in the search space."""
