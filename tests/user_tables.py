"""A table project written the way users write one, not the way this template does: scikit-learn's diabetes table
(it ships with the package), a plain LightningDataModule over plain DataLoaders, and a regression LightningModule
whose net ends in one output that forward squeezes away. Nothing here knows the template."""

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class DiabetesData(L.LightningDataModule):
    """442 patients, 10 standardised features, a disease progression score one year later (standardised here)."""

    def __init__(self, batch_size: int = 32, val_size: int = 100, shuffle: bool = True, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.val_size, self.shuffle, self.num_workers = batch_size, val_size, shuffle, num_workers

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.float32)
        x, y = (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()
        n = len(x) - self.val_size
        self.train_set, self.val_set = TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])

    def train_dataloader(self) -> DataLoader:
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, **workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class TableMLP(nn.Module):
    def __init__(self, features: int = 10, hidden: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.dropout(F.relu(self.fc2(F.relu(self.fc1(x))))))


class Regressor(L.LightningModule):
    """forward squeezes the net's (N, 1) output to (N,), the targets' shape: the loss is wrong without it."""

    def __init__(self, hidden: int = 32, lr: float = 0.01, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TableMLP(hidden=hidden, dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/mse", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/mse", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ScaledInput(Regressor):
    """forward changes the input before the net (a unit conversion): a strategy that feeds the net batch[0] itself
    would compute something else."""

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x * 2.0).squeeze(-1)


class LogsOnce(Regressor):
    """Logs its validation metric in the first epoch only (a condition left from debugging)."""

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 0:
            super().validation_step(batch, batch_idx)


class QuietInSanityCheck(Regressor):
    """Logs val/mse only outside Lightning's sanity check (a common way to keep its two batches out of the metric),
    val/mae always."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/mae", F.l1_loss(self(x), y))
        if not self.trainer.sanity_checking:
            self.log("val/mse", F.mse_loss(self(x), y))


class Buckets(torch.utils.data.Sampler):
    """Batches of indices, the way users write a bucketing batch sampler: not a subclass of torch's BatchSampler."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def __iter__(self):
        return iter([list(range(i, min(i + self.batch_size, self.n))) for i in range(0, self.n, self.batch_size)])

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


class BucketedDiabetesData(DiabetesData):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_sampler=Buckets(len(self.val_set), self.batch_size))


class PlateauRegressor(Regressor):
    """Halves its learning rate when val/mse stalls, the way Lightning's docs write it; the threshold is so large that
    every epoch stalls, so each epoch's end halves it."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=10.0, threshold_mode="abs"
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/mse"}}


class Overfits(Regressor):
    """Its validation score is best after the first epoch and worse at each one after (as an overfitting net's is)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/mse", F.mse_loss(self(x), y) + self.current_epoch)


class WeightedDiabetesData(DiabetesData):
    """Draws its training rows by weight (a WeightedRandomSampler, the usual answer to imbalanced data), or shuffles
    them with `weighted=False`."""

    def __init__(self, weighted: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.weighted = weighted

    def train_dataloader(self) -> DataLoader:
        if not self.weighted:
            return super().train_dataloader()
        weights = torch.linspace(1.0, 2.0, len(self.train_set))
        sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=len(self.train_set))
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)
