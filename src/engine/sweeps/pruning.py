"""Reports a per-epoch metric to this sweep job's Optuna trial, and stops training when the pruner says so. A pruned
job stops like an early-stopped one and ends normally: pruning is a decision of the search, not an error.
"""

import importlib
import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as L

from engine.sweeps.summary import PRUNED_FILE  # the job dir's mark of a pruned job

log = logging.getLogger(__name__)


def _sweeper_job() -> Any:
    """hydra_plugins.engine_optuna_sweeper.job, imported by name: mypy checks src/ by path, and an import statement of
    that namespace package would make it see one file under two names."""
    return importlib.import_module("hydra_plugins.engine_optuna_sweeper.job")


class OptunaPruning(L.Callback):
    """A no-op outside an Optuna sweep. `monitor` must improve in the study's direction (val/acc: maximize)."""

    def __init__(self, monitor: str = "val/acc") -> None:
        self.monitor = monitor
        self._trial: Any = None
        self._looked = False

    def _trial_of_this_job(self) -> Any:
        if not self._looked:  # once per run: loading the study costs a database round trip
            self._trial, self._looked = _sweeper_job().current_trial(), True
        return self._trial

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune, value = False, None
        if trainer.is_global_zero:  # one writer per trial: rank 0 reports and decides
            trial = self._trial_of_this_job()
            metric = trainer.callback_metrics.get(self.monitor)
            if trial is not None and metric is not None:
                value = float(metric)
                prune = _sweeper_job().report(trial, value, trainer.current_epoch)
        if trainer.world_size > 1:  # every rank stops together, or the others would wait for it forever
            prune = trainer.strategy.broadcast(prune, src=0)
        if not prune:
            return
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.info(f"Optuna pruned this trial after epoch {trainer.current_epoch}: {self.monitor}={value}")
            record = {"epoch": trainer.current_epoch, "monitor": self.monitor, "value": value}
            (Path(trainer.default_root_dir) / PRUNED_FILE).write_text(json.dumps(record) + "\n")
