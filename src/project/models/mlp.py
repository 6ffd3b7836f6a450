"""A small fully connected classifier."""

from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """Flatten, then Linear-ReLU(-Dropout) per hidden width, then a linear head.

    An nn.Sequential, so model parallelism can cut it between any two layers.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (256, 128),
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        if min((in_features, num_classes, *hidden)) < 1:
            raise ValueError(
                f"widths must be >= 1: in_features={in_features}, hidden={list(hidden)}, num_classes={num_classes}"
            )
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__()
        self.layers = nn.Sequential(*layers)
