"""Lightning's rich progress bar, taking the batch count and logged values at most `refresh_rate` times a second
(and at an epoch's last batch): Lightning's reads them back at every batch, a cost that shows on millisecond steps.
"""

from time import monotonic
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    def __init__(self, refresh_rate: int = 10, leave: bool = False, **kwargs: Any) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(
                f"refresh_rate must be a whole number of redraws a second (0 hides the bar), got {refresh_rate!r}"
            )
        super().__init__(refresh_rate=refresh_rate, leave=leave, **kwargs)
        self._next_update = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = monotonic()
        if now >= self._next_update or batch_idx + 1 == self.total_train_batches:
            self._next_update = now + 1 / max(1, self.refresh_rate)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
