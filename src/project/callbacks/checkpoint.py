"""last.ckpt at the end of every epoch and, with `every_n_steps`, also within epochs: what resume continues.

Lightning's ModelCheckpoint takes either epochs or steps, not both. A step save on an epoch's last batch
comes before that epoch's validation, and a run resumed from it would skip the validation and the epoch-end
hooks, so step saves leave that batch to the epoch-end save.
"""

from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
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
