"""Weights & Biases offline under the run dir (`wandb sync` uploads it later), each sweep job its own run (Lightning
would log a second in-process job into the first's open run). The run ends with the process: a shared W&B service
(`WANDB_SERVICE`) would keep it open, and resuming it failed with "run ID ... is in use".
"""

import atexit
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from engine.errors import UserError
from engine.loggers import tracking

log = logging.getLogger(__name__)

NAME = "wandb"
_OPEN: list["WandbLogger"] = []  # the logger whose W&B run this process has open (W&B keeps one at a time)


class WandbLogger(LightningWandbLogger):
    """`save_dir` holds `wandb/offline-run-<time>-<id>/`; `run_dir` keeps the id (trackers.json); `resume_from`
    is the checkpoint a resumed run trains on from, whose run dir names the W&B run to continue when `resume`."""

    def __init__(
        self,
        save_dir: str,
        project: str,
        run_dir: str,
        offline: bool = True,
        name: str | None = None,
        id: str | None = None,
        entity: str | None = None,
        tags: list[str] | None = None,
        resume_from: str | None = None,
        resume: bool = True,
    ) -> None:
        tracking.require("wandb", NAME)
        self._run_dir = run_dir
        self._failed = False  # how the last fit or test ended: the run ends so
        continued = tracking.continued(NAME, run_dir, resume_from, resume) if id is None else None
        if continued is not None:
            id = str(continued["id"])
            log.info("Continuing W&B run %s", id)
        sweep_dir = tracking.sweep_dir()
        super().__init__(
            name=name or tracking.run_name(run_dir),
            save_dir=save_dir,
            offline=offline,
            id=id,
            project=project,
            entity=entity,
            tags=tags,
            group=f"sweep {Path(sweep_dir).name}" if sweep_dir else None,  # a sweep's jobs side by side
        )
        self._wandb_init.pop("anonymous", None)  # Lightning passes it always; wandb warns that it does nothing

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            import wandb

            for earlier in _OPEN:  # an earlier sweep job's, in this same process: it has ended, as it ended
                earlier._finish()
            if wandb.run is not None:  # opened by other code of the process
                wandb.run.finish()
            try:
                super().experiment
            except Exception as e:
                raise UserError(f"logger.wandb: {tracking.one_line(e)}") from e
            assert self._experiment is not None
            _OPEN[:] = [self]
            atexit.register(self._finish)
            offline_run = str(Path(self._experiment.dir).parent)  # <save_dir>/wandb/offline-run-<time>-<id>
            ids = {"id": self._experiment.id, "project": self._project, "dir": offline_run}
            tracking.remember(self._run_dir, NAME, ids)
        return self._experiment

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._failed = status != "success"
        super().finalize(status)

    def _finish(self) -> None:
        """When the next sweep job starts, or at exit (before W&B's own hooks, registered earlier): the run ends
        as the last fit or test ended. Ending it twice does nothing."""
        if self in _OPEN:
            _OPEN.remove(self)
        if self._experiment is not None:
            self._experiment.finish(exit_code=1 if self._failed else 0)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The run config as W&B's nested config, and the config groups chosen under `groups`."""
        super().log_hyperparams(params)
        if "groups" not in self.experiment.config:
            self.experiment.config.update({"groups": tracking.chosen_groups()}, allow_val_change=True)
