"""torchvision's ResNet-18, adapted to small images with few channels."""

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


class ResNet18(ResNet):
    """torchvision's ResNet-18 (conv1, bn1, layer1..layer4, fc: its module names and forward), with a 3x3
    stride-1 first convolution and no max-pool: the ImageNet stem would shrink 28x28 images to 7x7 at once.
    pipe and pipeline cut it where the classic tutorials cut ResNets: `trainer.strategy.split_points=[layer3]`."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        if in_channels < 1 or num_classes < 1:
            raise ValueError(f"in_channels={in_channels}, num_classes={num_classes}: must be >= 1")
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.maxpool = nn.Identity()
