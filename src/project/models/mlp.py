"""A small fully connected classifier."""

from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Flatten, then Linear-ReLU(-Dropout) per hidden width, then a linear head."""

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (256, 128),
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)
