"""A net with its input normalization built in: what export.py writes, so that users feed raw pixels."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class RawPixels(nn.Module):
    """pixels (N, C, H, W), uint8 0-255 -> the net's logits (N, num_classes), scaled and standardized exactly
    as the training data was ((x / 255 - mean) / std per channel) inside the module."""

    mean: Tensor  # registered buffers: saved with the module, exported as constants
    std: Tensor

    def __init__(self, net: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean {list(mean)} and std {list(std)}: one value of each per channel")
        self.net = net
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, pixels: Tensor) -> Tensor:
        return self.net((pixels.to(torch.float32) / 255.0 - self.mean) / self.std)
