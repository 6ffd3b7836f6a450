"""The LightningModule of a regression on rows of numbers (a table): any net with one output per row, its squared
error, and its optimizer. The worked example beside the image classifier: `python train.py model=regressor
data=diabetes`."""

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor, nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MinMetric

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Regressor(L.LightningModule):
    """Trains `net` (rows (N, features) -> (N, 1)) on the mean squared error; logs mse and mae per split."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        features: int = 10,
        monitor: str = "val/mse",
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.monitor = monitor  # what a plateau scheduler watches: the run's monitor.metric
        self.example_input_array = torch.zeros(2, features)  # the model summary, export's example input
        self.criterion = nn.MSELoss()
        self.train_mse, self.val_mse, self.test_mse = MeanSquaredError(), MeanSquaredError(), MeanSquaredError()
        self.val_mae, self.test_mae = MeanAbsoluteError(), MeanAbsoluteError()
        self.val_mse_best = MinMetric()
        self.val_mse_best.persistent(True)  # in checkpoints, so a resumed run still knows its best

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)  # one number per row, shaped like the targets

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        prediction = self(x)
        loss = self.criterion(prediction, y)
        self.train_mse.update(prediction.detach(), y)
        self.log("train/loss", loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        if self.train_mse.update_count:  # an epoch resumed at its end ran no step
            self.log("train/mse", self.train_mse, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        prediction = self(x)
        self.val_mse.update(prediction, y)
        self.val_mae.update(prediction, y)

    def on_validation_epoch_end(self) -> None:
        self.log("val/mse", self.val_mse, prog_bar=True)
        self.log("val/mae", self.val_mae)
        if self.trainer.sanity_checking:
            return
        self.val_mse_best.update(self.val_mse.compute())
        self.log("val/mse_best", self.val_mse_best.compute(), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        prediction = self(x)
        self.test_mse.update(prediction, y)
        self.test_mae.update(prediction, y)

    def on_test_epoch_end(self) -> None:
        self.log("test/mse", self.test_mse)
        self.log("test/mae", self.test_mae)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """One number per row of `batch["input"]`, in the target's own units (what predict.py writes per row)."""
        return self(batch["input"]).float()

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": "epoch"}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.monitor
        return {"optimizer": optimizer, "lr_scheduler": config}
