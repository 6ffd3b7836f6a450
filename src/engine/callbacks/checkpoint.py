"""last.ckpt at every epoch end and, with `every_n_steps`, within epochs too (Lightning's takes one or the other).
A step save leaves an epoch's last batch to the epoch-end save: a resume from it would skip that validation.
Writes go to a thread (engine.runs.atomic_io); a best file saved just before last.ckpt becomes it by hard link.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as L
import torch
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

    def _monitor_candidates(self, trainer: L.Trainer) -> dict[str, Any]:
        """Lightning's, with tensors cloned instead of deep-copied: as independent, at an eighth of the cost
        (benchmarks/per_call.py)."""
        candidates = {
            key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in trainer.callback_metrics.items()
        }
        epoch, step = candidates.get("epoch"), candidates.get("step")
        candidates["epoch"] = epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
        candidates["step"] = step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
        return candidates

    def file_exists(self, filepath: Any, trainer: L.Trainer) -> bool:
        wait_for_writes(trainer)  # a file still being written exists: the version counter must not reuse its name
        return super().file_exists(filepath, trainer)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        wait_for_writes(trainer)  # `save_last: link`: never a link to a file not yet written
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        wait_for_writes(trainer)  # before the loggers finish (MLflow logs the best file) and what reads them next


class BestCheckpoint(WrittenInBackground):
    """Lightning's ModelCheckpoint (the top `save_top_k` by `monitor`), written in the background."""

    _called: object | None = None  # a new token at each call of a hook in which it may save
    _saved_in: object | None = None  # the token of the call in which it saved last

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._called = object()
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._called = object()
        super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._called = object()
        super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._called = object()
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._called = object()  # last.ckpt's save_on_exception comes after it: never a link to an older best file
        super().on_exception(trainer, pl_module, exception)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._saved_in = self._called

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._trainer = proxy(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run writes into a new run dir, for which Lightning keeps the best file's path but forgets its
        score: the first new epoch became the best, worse or not, and was tested. The best files come along into
        this dir (hard links), so the top k are the unbroken run's, and replacing one never touches the old run."""
        saved = state_dict.get("dirpath")
        if saved and self.dirpath and Path(saved) != Path(self.dirpath) and state_dict.get("best_k_models"):
            state_dict = self._brought_over(state_dict)
        super().load_state_dict(state_dict)

    def _brought_over(self, state: dict[str, Any]) -> dict[str, Any]:
        from engine.runs.atomic_io import copy_atomically

        trainer = getattr(self, "_trainer", None)
        resumed_from = Path(str(getattr(trainer, "ckpt_path", None) or "")).parent
        moved: dict[str, str] = {}
        for old in state["best_k_models"]:
            source = Path(old) if Path(old).is_file() else resumed_from / Path(old).name  # a run dir moved since
            if not source.is_file():
                continue
            moved[old] = str(Path(str(self.dirpath)) / source.name)
            if trainer is None or trainer.is_global_zero:
                copy_atomically(source, Path(moved[old]))
        if not moved:
            return state  # not there any more (or folders of shards): Lightning's behaviour
        kept = {moved[old]: score for old, score in state["best_k_models"].items() if old in moved}
        scores = sorted(kept.items(), key=lambda item: float(item[1]), reverse=self.mode == "max")
        return {
            **state,
            "dirpath": self.dirpath,
            "best_k_models": kept,
            "best_model_path": scores[0][0],
            "best_model_score": scores[0][1],
            "kth_best_model_path": scores[-1][0],
            "kth_value": scores[-1][1],
            "last_model_path": "",
        }

    def saved_just_now(self) -> bool:
        """Whether it saved a file in its newest hook call."""
        return self._saved_in is not None and self._saved_in is self._called

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

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        best = self._best_saved_just_before(trainer, filepath)
        if best is None:
            return super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:  # the ranks decide alike (from the callbacks' states): none collects the state
            with self._in_background(trainer, filepath):
                trainer.strategy.checkpoint_io.save_copy(best._last_checkpoint_saved, filepath)  # type: ignore[attr-defined]
        trainer.strategy.barrier("Trainer.save_checkpoint")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _best_saved_just_before(self, trainer: L.Trainer, filepath: str) -> "BestCheckpoint | None":
        """The best callback, if its save right before this one holds the state this one would (module docstring)."""
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        at = next((i for i, callback in enumerate(callbacks) if callback is self), 0)
        best = callbacks[at - 1] if at > 0 else None
        if not isinstance(best, BestCheckpoint) or not best.saved_just_now():
            return None
        local = "://" not in f"{best._last_checkpoint_saved}{filepath}"
        sharded = getattr(trainer.strategy, "_save_distributed_checkpoint", False)  # fsdp's folders of shards
        copies = callable(getattr(trainer.strategy.checkpoint_io, "save_copy", None))
        same = best.save_weights_only == self.save_weights_only
        return best if local and not sharded and copies and same else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if not self.every_n_steps or trainer.global_step % self.every_n_steps or trainer.sanity_checking:
            return
        if self._last_global_step_saved == trainer.global_step:
            return  # a batch that only accumulated gradients: a save here would resume without them
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the epoch-end save follows, after validation
        self._save_checkpoint(trainer, str(self.path))


def wait_for_writes(trainer: L.Trainer) -> None:
    """Until every save handed to the writer thread is written (engine.runs.atomic_io); a failed write raises."""
    wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
    if wait is not None:
        wait()


def _a_logger_reads_checkpoints(trainer: L.Trainer) -> bool:
    return any(
        getattr(logger, name, False) for logger in trainer.loggers for name in ("_log_model", "_log_model_checkpoints")
    )
