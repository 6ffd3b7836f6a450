"""Lightning's rich progress bar, redrawn every `refresh_rate` training batches (and at an epoch's last one).

Lightning's redraws the bar and reads every logged progress-bar value back at every batch, whatever its
refresh_rate says: about a tenth of a millisecond each, a tenth of a small net's step (benchmarks/step_loop.py).
"""

from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done = batch_idx + 1
        if done % max(1, self.refresh_rate) == 0 or done == self.total_train_batches:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
