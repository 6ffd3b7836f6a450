"""The classic LeNet-style CNN for small grey-scale images."""

from collections.abc import Sequence

from torch import nn


class LeNet(nn.Sequential):
    """Two conv-BN-ReLU-pool blocks, then two linear layers; 28x28 input becomes 7x7 feature maps.

    An nn.Sequential (features, then classifier), so model parallelism can cut it between any two layers.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        dropout: float = 0.0,
        image_size: int = 28,
    ) -> None:
        if min((in_channels, num_classes, hidden, *channels)) < 1 or image_size < 2 ** len(channels):
            raise ValueError(
                f"widths must be >= 1 and image_size >= 2^{len(channels)}: in_channels={in_channels}, "
                f"channels={list(channels)}, hidden={hidden}, num_classes={num_classes}, image_size={image_size}"
            )
        blocks: list[nn.Module] = []
        c_in = in_channels
        for c_out in channels:
            blocks += [
                nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            c_in = c_out
        side = image_size // 2 ** len(channels)
        classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c_in * side * side, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        super().__init__()
        self.features = nn.Sequential(*blocks)
        self.classifier = classifier
