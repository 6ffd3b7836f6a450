"""Models written the way users write them, not the way this template does: every feature is tested with these
too (docs/your-model.md). None is an nn.Sequential; none is the template's ImageClassifier net."""

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The overrides that make a run train LitAutoEncoder (below) in place of the template's model: the autoencoder
# config's keys it does not take removed, and a metric it logs monitored.
LIT_AUTOENCODER = (
    "model=autoencoder",
    *(f"~model.{key}" for key in ("in_channels", "image_size", "latent", "lr")),
    "model._target_=user_models.LitAutoEncoder",
    "monitor.metric=train_loss",
    "monitor.mode=min",
)
# ... 3 short epochs of it on the CPU, without a test
LIT_AUTOENCODER_3_EPOCHS = (
    *LIT_AUTOENCODER,
    "trainer.accelerator=cpu",
    "trainer.max_epochs=3",
    "+trainer.limit_train_batches=4",
    "test=false",
)


class TutorialCNN(nn.Module):
    """The CNN of PyTorch's classic CIFAR-10 and DataParallel tutorials (layers in __init__, functional ReLU, one
    pooling layer called twice), sized for 28x28 digits. A BatchNorm layer, as such nets often have."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.bn = nn.BatchNorm2d(16)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.bn(self.conv2(x))))
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class ResidualNet(nn.Module):
    """A stem, repeated residual blocks (a skip connection around each), a head; dropout through F.dropout with
    self.training, so its forward differs between train and eval mode."""

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 8, depth: int = 3, dropout: float = 0.0
    ):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))
        skip = x
        for block in self.blocks:
            x = block(x)
        x = x + skip  # a connection over every block: crosses any cut between them
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.head(F.dropout(x, self.dropout, training=self.training))


class Gated(nn.Module):
    """A forward that branches on a tensor's value: torch.fx cannot trace it."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if x.mean() > 0:
            x = x.relu()
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class GatedNet(nn.Module):
    """The untraceable part inside a submodule: `leaves=[Gated]` keeps it whole and the rest is cut."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 1, 1)
        self.gated = Gated()

    def forward(self, x: Tensor) -> Tensor:
        return self.gated(self.stem(x))


class LitAutoEncoder(L.LightningModule):
    """Lightning's own README example, as users copy it: training_step calls the encoder and decoder itself, no
    validation_step, the optimizer made in configure_optimizers, hyperparameters saved."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28))

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x.view(x.size(0), -1))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class KeepsItsNet(L.LightningModule):
    """What lightning-hydra-template's modules do: save_hyperparameters() with an nn.Module argument."""

    def __init__(self, net: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class DictOutCNN(TutorialCNN):
    """A net that returns its logits in a dict (as some libraries' models do): not what a classifier trains on."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        return {"logits": super().forward(x)}


class AuxOutCNN(TutorialCNN):
    """Logits and an auxiliary head's, in training only (torchvision's googlenet and inception_v3 do this)."""

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return (logits, logits.detach()) if self.training else logits


class NoWeights(nn.Module):
    """Nothing to train: a fixed projection of the pixels (a baseline)."""

    def __init__(self, num_classes: int = 10, **_: object) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(1)[:, : self.num_classes]


class SevenOutputs(TutorialCNN):
    """Its last layer's size written into the net, whatever num_classes it is given."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__(in_channels, 7)


class UnusedHead(TutorialCNN):
    """A head built in __init__ that forward never calls (left from an experiment, or used only elsewhere)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__(in_channels, num_classes)
        self.aux_head = nn.Linear(84, num_classes)


class TakesTwo(TutorialCNN):
    """A forward with a second input (a mask, a condition) and no default for it."""

    def forward(self, x: Tensor, scale: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x) * scale


class TiedAutoEncoderNet(nn.Module):
    """Encoder and decoder sharing one weight (the decoder uses it transposed), as tied autoencoders and language
    models' embeddings do; classifies from the code."""

    def __init__(self, num_classes: int = 10, **_: object) -> None:
        super().__init__()
        self.enc = nn.Linear(28 * 28, 32)
        self.dec = nn.Linear(32, 28 * 28)
        self.dec.weight = self.enc.weight  # tied: the same (32, 784) tensor, used as its transpose below
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        code = torch.relu(self.enc(x.flatten(1)))
        recon = F.linear(code, self.dec.weight.t(), self.dec.bias)
        return self.head(code) + 0.0 * recon.mean()


class CountsItsSteps(TutorialCNN):
    """Counts its training forwards in a buffer of its own, in its own forward (a warm-up schedule, say)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__(in_channels, num_classes)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.steps += 1
        return super().forward(x)
