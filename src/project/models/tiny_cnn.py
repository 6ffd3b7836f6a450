"""The "Add your model" example (README, docs/your-model.md): a small CNN for images of any size (copy this file to
start yours)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyCNN(nn.Module):
    """Two conv-ReLU layers, global average pooling, a linear head: images (N, C, H, W) -> logits (N, classes).

    Written the usual way, layers in __init__ and a forward that calls them: pipe, pipeline and fsdp cut and
    shard it by the names of its layers (`trainer.strategy.split_points=[conv2]`)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        if min(in_channels, num_classes, width) < 1:
            raise ValueError(f"in_channels={in_channels}, num_classes={num_classes}, width={width}: must be >= 1")
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
