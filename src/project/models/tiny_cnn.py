"""The README's "Add your model" example: a small CNN for images of any size (copy this file to start yours)."""

from torch import nn


class TinyCNN(nn.Sequential):
    """Two conv-ReLU blocks, global average pooling, a linear head: images (N, C, H, W) -> logits (N, classes).

    An nn.Sequential of blocks, so pipe and fsdp can split and shard it like the template's nets."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        if min(in_channels, num_classes, width) < 1:
            raise ValueError(f"in_channels={in_channels}, num_classes={num_classes}, width={width}: must be >= 1")
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))
