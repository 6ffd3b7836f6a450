"""The one metric that judges a run (`monitor.metric`, `monitor.mode`): its best value, which `train` returns to
sweepers and writes as `best/<metric>`, and one clear line when a callback watches a metric nobody logs (Lightning's
own are an EarlyStopping traceback and a ModelCheckpoint list); it runs first, so it checks before they look.
"""

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from engine.errors import UserError
from engine.runs.results import best_key

__all__ = ["Monitor", "best_key"]


class Monitor(L.Callback):
    """Tracks the best `metric` (`mode`: max or min) over the run, saved with checkpoints so a resumed run keeps it."""

    def __init__(self, metric: str = "val/acc", mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r}: max or min")
        self.metric, self.mode = metric, mode
        self.best: float | None = None
        self.best_epoch: int | None = None
        self._validations = 0  # this epoch's
        self._started_at: int | None = None  # the epoch's completed batches when it started (a resume restores them)
        self._logged_in: int | None = None  # the last epoch whose validation logged the metric
        self._before: Any = None  # its value object as the validation started

    @property
    def state_key(self) -> str:
        return f"Monitor[{self.metric}]"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.best_epoch = state_dict.get("best"), state_dict.get("best_epoch")

    def _watchers(self, trainer: L.Trainer, at_epoch_end: bool) -> list[tuple[str, str]]:
        """(who, metric) for every callback that reads its metric now: at the train epoch's end or at validation's."""
        found = []
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            monitor = getattr(callback, "monitor", None)
            if not isinstance(monitor, str) or not monitor:
                continue
            if isinstance(callback, EarlyStopping):
                reads_at_epoch_end = bool(callback._check_on_train_epoch_end)
            elif isinstance(callback, ModelCheckpoint):
                reads_at_epoch_end = callback._should_save_on_train_epoch_end(trainer)
            elif isinstance(callback, Monitor):
                reads_at_epoch_end = self._reads_at_epoch_end(trainer)
            else:  # Optuna pruning, and callbacks of a user's: at validation's end, where metrics are fresh
                reads_at_epoch_end = False
            if reads_at_epoch_end == at_epoch_end:
                found.append((type(callback).__name__, monitor))
        return found

    @staticmethod
    def _reads_at_epoch_end(trainer: L.Trainer) -> bool:
        return trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0

    def _check(self, trainer: L.Trainer, at_epoch_end: bool) -> None:
        for who, metric in self._watchers(trainer, at_epoch_end):
            if metric not in trainer.callback_metrics:
                raise self._missing(trainer, who, metric)

    @staticmethod
    def _missing(trainer: L.Trainer, who: str, metric: str) -> UserError:
        logged = sorted(trainer.callback_metrics)
        module = type(trainer.lightning_module).__name__
        scores = [m for m in logged if not m.startswith("lr-")]  # not a learning rate
        some = next((m for m in scores if "val" in m), scores[0] if scores else None)
        lower = some is not None and any(word in some for word in ("loss", "err", "mae", "mse", "rmse"))
        example = f", e.g. monitor.metric={some} monitor.mode={'min' if lower else 'max'}" if some else ""
        return UserError(
            f"{who} watches {metric!r}, which {module} never logged; it logged: "
            f"{', '.join(logged) or 'nothing'}. Set monitor.metric to a score it logs (and monitor.mode to "
            f"max or min){example}, or log one with self.log"
        )

    def _stopped_logging(self, trainer: L.Trainer) -> None:
        module = type(trainer.lightning_module).__name__
        raise UserError(
            f"{module} logged {self.metric} in the validation of epoch {self._logged_in} but not in epoch "
            f"{trainer.current_epoch}'s: monitor.metric would judge the run on a stale value; log it at every "
            "validation, or monitor another metric (monitor.metric)"
        )

    def _update(self, trainer: L.Trainer) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if value is None or trainer.sanity_checking:
            return
        number = float(value)  # once per validation: the one host sync of this callback
        better = self.best is None or (number > self.best if self.mode == "max" else number < self.best)
        if math.isfinite(number) and better:
            self.best, self.best_epoch = number, trainer.current_epoch

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A watched validation metric that the sanity check did not log, and whose name the module's code does not
        # hold, ends the run before it trains (no run dir left), not an epoch later. A name the code holds may be
        # logged outside the sanity check only (`if not self.trainer.sanity_checking`): checked at validation's end.
        if not any(m.startswith("val") for m in trainer.callback_metrics):
            return
        for who, metric in self._watchers(trainer, True) + self._watchers(trainer, False):
            if metric.startswith("val") and metric not in trainer.callback_metrics and not _in_code(pl_module, metric):
                raise self._missing(trainer, who, metric)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started_at = trainer.fit_loop.epoch_loop.batch_progress.current.completed

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = trainer.callback_metrics.get(self.metric)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # Lightning keeps a metric's last value when a validation logs it no more (a new value is a new tensor): a
        # metric once logged in validation and then not would go on judging the run on its stale value
        now = trainer.callback_metrics.get(self.metric)
        if now is not None and now is not self._before:
            self._logged_in = trainer.current_epoch
        elif self._logged_in is not None:
            self._stopped_logging(trainer)
        self._validations += 1
        self._check(trainer, at_epoch_end=False)
        if not self._reads_at_epoch_end(trainer):
            self._update(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # an epoch that ran nothing (resumed at its end, after its validation) has nothing new to look at
        completed = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        steps = completed - (self._started_at if self._started_at is not None else completed)
        if steps or self._validations:
            # also without a validation (a module without validation_step): checkpoints and early stopping look now
            self._check(trainer, at_epoch_end=True)
            if self._reads_at_epoch_end(trainer):
                self._update(trainer)
        self._validations, self._started_at = 0, None


def _in_code(module: L.LightningModule, name: str) -> bool:
    """Whether the source of the module's class, or of a class it derives from, holds `name` as written."""
    import inspect

    for cls in type(module).__mro__:
        if cls.__module__.startswith(("lightning.", "torch.")) or cls is object:
            continue
        try:
            if name in inspect.getsource(cls):
                return True
        except (OSError, TypeError):  # no source (a class made at run time): nothing to say
            continue
    return False
