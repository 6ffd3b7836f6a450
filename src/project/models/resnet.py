"""torchvision's ResNet-18, adapted to small images with few channels, as a sequence of blocks."""

from torch import nn


class ResNet18(nn.Sequential):
    """stem, layer1..layer4, head: torchvision's ResNet-18 blocks in call order, so model parallelism can cut it
    where the classic tutorials cut ResNet-50 (between the layers). The stem is a 3x3 stride-1 convolution
    without max-pool: the ImageNet stem would shrink 28x28 images to 7x7 at once."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        from torchvision.models import resnet18

        net = resnet18(weights=None, num_classes=num_classes)
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False), net.bn1, net.relu
        )
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.head = nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)
