"""An autoencoder on images: a LightningModule of another task than classification, written the way most
LightningModules in the wild are (save_hyperparameters, the optimizer in configure_optimizers), as the classic
multi-node DDP tutorial's model is. It is the worked example of "your own LightningModule" (docs/your-model.md): it
logs val/loss (model=autoencoder picks monitor=val_loss), draws its reconstructions in TensorBoard, predicts the
latent code of each image and exports its reconstruction."""

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AutoEncoder(L.LightningModule):
    """Images (N, C, H, W) -> a `latent`-number code -> the images again; trained on the mean squared error."""

    def __init__(
        self, in_channels: int = 1, image_size: int = 28, hidden: int = 128, latent: int = 16, lr: float = 2e-3
    ):
        super().__init__()
        if min(in_channels, image_size, hidden, latent) < 1 or lr <= 0:
            raise ValueError(f"sizes must be >= 1 and lr > 0: {in_channels}, {image_size}, {hidden}, {latent}, {lr}")
        self.save_hyperparameters()
        pixels = in_channels * image_size * image_size
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(pixels, hidden), nn.ReLU(), nn.Linear(hidden, latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, pixels))
        self.example_input_array = torch.zeros(2, in_channels, image_size, image_size)

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction of `x` (what export.py writes)."""
        return self.decoder(self.encoder(x)).view_as(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        loss = F.mse_loss(self(x), x)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, _ = batch
        reconstruction = self(x)
        self.log("val/loss", F.mse_loss(reconstruction, x), prog_bar=True, sync_dist=True)  # over all ranks
        if batch_idx == 0 and not self.trainer.sanity_checking:
            self._draw(x[:16], reconstruction[:16])

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, _ = batch
        self.log("test/loss", F.mse_loss(self(x), x), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The latent code of each image (predict.py writes one row of `latent` numbers per input)."""
        x = batch["input"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.encoder(x).float()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])

    def _draw(self, images: Tensor, reconstructions: Tensor) -> None:
        """Originals above their reconstructions, in TensorBoard's Images tab (rank 0, TensorBoard loggers only)."""
        from lightning.pytorch.loggers import TensorBoardLogger
        from torchvision.utils import make_grid

        if not self.trainer.is_global_zero:
            return
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                pairs = torch.cat([images, reconstructions]).detach().float().cpu()
                grid = make_grid(pairs, nrow=len(images), normalize=True)
                logger.experiment.add_image("val/reconstructions", grid, self.global_step)
