"""torchvision's ResNet-18, adapted to small images with few channels."""

from torch import nn


def resnet18(in_channels: int = 1, num_classes: int = 10) -> nn.Module:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool: the ImageNet stem would shrink 28x28 to 7x7 at once."""
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net
