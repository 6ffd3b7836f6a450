"""last.ckpt at the end of every epoch and, with `every_n_steps`, also within epochs: what resume continues.

Lightning's ModelCheckpoint takes either epochs or steps, not both. A step save on an epoch's last batch
comes before that epoch's validation, and a run resumed from it would skip the validation and the epoch-end
hooks, so step saves leave that batch to the epoch-end save.

Both checkpoint callbacks (the best by the monitored metric, and last.ckpt) hand their writes and the removal of a
replaced best file to a writer thread while training goes on (project.runs.atomic_io); the files are complete
when the stage ends (the callbacks' teardown, before the loggers finish) and before any other save or load. Not
when a logger uploads checkpoint files as they are saved (`log_model` of Lightning's MLflow, W&B or LitLogger;
`log_model_checkpoints` of Neptune's): those read the file at once, so it is written before they hear of it.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint


class WrittenInBackground(ModelCheckpoint):
    """A ModelCheckpoint whose saves and removals the writer thread does (the module docstring)."""

    @contextmanager
    def _in_background(self, trainer: L.Trainer, filepath: str) -> Iterator[None]:
        in_background = getattr(trainer.strategy.checkpoint_io, "in_background", None)
        if in_background is None or _a_logger_reads_checkpoints(trainer):
            yield
        else:
            with in_background(filepath):
                yield

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        with self._in_background(trainer, filepath):
            super()._save_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        with self._in_background(trainer, filepath):  # a replaced best file: after its successor is written
            super()._remove_checkpoint(trainer, filepath)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        # Lightning's looks at the trainer's state at every step (about 10 µs) to decide what only
        # every_n_train_steps or train_time_interval can make it do
        if self._every_n_train_steps >= 1 or self._train_time_interval is not None:
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def file_exists(self, filepath: Any, trainer: L.Trainer) -> bool:
        _wait(trainer)  # a file still being written exists: the version counter must not reuse its name
        return super().file_exists(filepath, trainer)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        _wait(trainer)  # `save_last: link`: never a link to a file not yet written
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        _wait(trainer)  # before the loggers finish (an MLflow run logs the best file) and whatever reads them next


class BestCheckpoint(WrittenInBackground):
    """Lightning's ModelCheckpoint (the top `save_top_k` by `monitor`), written in the background."""

    @property
    def state_key(self) -> str:
        # Lightning's own key ("ModelCheckpoint{...}"): a checkpoint saved before this class existed resumes with
        # its best file and score known
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)


class LastCheckpoint(WrittenInBackground):
    """`dirpath`/last.ckpt, rewritten every epoch and every `every_n_steps` optimizer steps (null: epochs only)."""

    def __init__(self, dirpath: str, every_n_steps: int | None = None, **kwargs: Any) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or null, got {every_n_steps}")
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            every_n_epochs=1,
            enable_version_counter=False,
            **kwargs,
        )
        self.every_n_steps = every_n_steps

    @property
    def path(self) -> Path:
        return Path(str(self.dirpath)) / f"last{self.FILE_EXTENSION}"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if not self.every_n_steps or trainer.global_step % self.every_n_steps or trainer.sanity_checking:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the epoch-end save follows, after validation
        self._save_checkpoint(trainer, str(self.path))


def _wait(trainer: L.Trainer) -> None:
    wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
    if wait is not None:
        wait()


def _a_logger_reads_checkpoints(trainer: L.Trainer) -> bool:
    return any(
        getattr(logger, name, False) for logger in trainer.loggers for name in ("_log_model", "_log_model_checkpoints")
    )
