"""The LightningModule: any image classification net, its loss, metrics and optimizer."""

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class ImageClassifier(L.LightningModule):
    """Trains `net` (images -> logits) with cross-entropy; logs loss and accuracy per split.

    `optimizer` and `scheduler` are factories (Hydra partials), so the config picks them; `monitor` is the metric a
    plateau scheduler watches (the run's monitor.metric). Hyperparameters are not saved here: every checkpoint carries
    the plain run config instead, loads with torch.load(weights_only=True) and rebuilds this module.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        num_classes: int = 10,
        compile: bool | str = False,
        monitor: str = "val/acc",
    ) -> None:
        super().__init__()
        if isinstance(compile, str) and compile not in torch.compiler.list_backends(exclude_tags=()):
            backends = ", ".join(torch.compiler.list_backends())
            raise ValueError(
                f"compile={compile!r} is not a torch.compile backend; use true, false or one of {backends} (for "
                "debugging: aot_eager, eager)"
            )
        self.net = net
        self.num_classes = num_classes
        self.compile_net = compile
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.monitor = monitor
        self.criterion = nn.CrossEntropyLoss(reduction="none")  # per sample: an epoch's mean does not hang on batching
        # One metric object per split: their states must not mix (validation runs inside the training epoch).
        # No argument checks and no NaN search per update: each would read the device from the host every step.
        self.train_loss, self.val_loss, self.test_loss = (MeanMetric(nan_strategy="disable") for _ in range(3))
        self.train_acc, self.val_acc, self.test_acc = (
            MulticlassAccuracy(num_classes, average="micro", validate_args=False) for _ in range(3)
        )
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so a resumed run still knows its best

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def configure_model(self) -> None:
        """Let the strategy spread the net over its devices first (fsdp shards it, pipe cuts it), then compile it
        if asked. Lightning calls this before every fit, validate and test: both steps happen once."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.net)
        if self.compile_net and not getattr(self, "_compiled", False):
            # compiles forward in place: state_dict keys stay the same, so checkpoints load with or without it
            self.net.compile(**({"backend": self.compile_net} if isinstance(self.compile_net, str) else {}))
            self._compiled = True

    def _shared_step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y  # the loss of each sample

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        losses, preds, y = self._shared_step(batch)
        loss = losses.mean()
        self.train_loss.update(losses.detach())
        self.train_acc.update(preds, y)
        self.log("train/loss_step", loss.detach())  # not in the progress bar: that reads it from the device every step
        return loss

    def on_train_epoch_end(self) -> None:
        # Metric objects: Lightning computes them over the epoch (synced over ranks) and resets them. An epoch that
        # ran no training step (resumed from a checkpoint saved at its end) logs nothing, not NaN.
        if self.train_loss.update_count:
            self.log("train/loss_epoch", self.train_loss, prog_bar=True)
            self.log("train/acc", self.train_acc, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        losses, preds, y = self._shared_step(batch)
        self.val_loss.update(losses)
        self.val_acc.update(preds, y)
        return {"preds": preds, "target": y}  # for callbacks: the confusion matrix, the sample grid

    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
        if self.trainer.sanity_checking:  # a look at untrained (or just restored) weights: not a result
            return
        self.val_acc_best.update(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        losses, preds, y = self._shared_step(batch)
        self.test_loss.update(losses)
        self.test_acc.update(preds, y)
        return {"preds": preds, "target": y}  # for callbacks: the test set's confusion matrix and sample grid

    def on_test_epoch_end(self) -> None:
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Class probabilities (N, num_classes) for a batch of images (predict.py's {"input": ..., "name": ...}, or
        the images alone or first of a tuple), as float32 also under mixed precision: what predict.py writes."""
        x = batch["input"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).float().softmax(dim=1)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": "epoch"}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.monitor
        return {"optimizer": optimizer, "lr_scheduler": config}
