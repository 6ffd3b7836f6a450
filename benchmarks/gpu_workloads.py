"""The nets and synthetic data gpu_models.py times, at full and tiny shapes; train.py's runs import them by target."""

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from engine.data.tensors import TensorDataModule, TensorDataset


@dataclass(frozen=True)
class Shape:
    batch: int
    image: int = 224  # resnet50
    classes: int = 1000
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    context: int = 1024  # gpt2
    layers: int = 12
    heads: int = 12
    embd: int = 768


SHAPES = {
    "resnet50": {"full": Shape(batch=128), "tiny": Shape(batch=4, image=32, classes=10, blocks=(1, 1, 1, 1), width=16)},
    "gpt2": {"full": Shape(batch=16), "tiny": Shape(batch=4, context=32, layers=2, heads=2, embd=32)},
}


# --- the nets ---------------------------------------------------------------------------------------------------


def resnet50(
    num_classes: int = 1000,
    weights: Any = None,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    compile: bool | str = False,
) -> nn.Module:
    """torchvision's ResNet-50 (Bottleneck blocks 3-4-6-3, width 64), channels_last, taking any input (made
    channels_last in forward: a no-op for input that is). `blocks`, `width`: the tiny shape's. `weights`: what
    model=torchvision passes (null)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    class ChannelsLastResNet(ResNet):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x.contiguous(memory_format=torch.channels_last))

    assert weights is None, "synthetic data: no pretrained weights"
    net = ChannelsLastResNet(Bottleneck, list(blocks), num_classes=num_classes, width_per_group=width)
    net = net.to(memory_format=torch.channels_last)
    if compile:
        net.compile(**({"backend": compile} if isinstance(compile, str) else {}))
    return net


def gpt(
    block_size: int = 1024, n_layer: int = 12, n_head: int = 12, n_embd: int = 768, dropout: float = 0.0, compile=False
) -> nn.Module:
    """The template's GPT (project.models.gpt), compiled in place when asked, as the classifier compiles its net."""
    from project.models.gpt import GPT

    net = GPT(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)
    if compile:
        net.compile(**({"backend": compile} if isinstance(compile, str) else {}))
    return net


def build(model: str, shape: Shape, compile: bool | str = False) -> nn.Module:
    if model == "resnet50":
        return resnet50(shape.classes, blocks=shape.blocks, width=shape.width, compile=compile)
    return gpt(shape.context, shape.layers, shape.heads, shape.embd, compile=compile)


def loss_of(model: str) -> Callable[[Tensor, Tensor], Tensor]:
    if model == "resnet50":
        return F.cross_entropy
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def optimizer_of(model: str, params: Any) -> torch.optim.Optimizer:
    if model == "resnet50":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.0005)
    return torch.optim.AdamW(params, lr=0.001, weight_decay=0.01)


def pool(model: str, shape: Shape, n: int, device: torch.device | str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor]:
    """`n` synthetic samples: images (n, 3, H, W) standardised and labels, or token windows and the tokens after."""
    g = torch.Generator().manual_seed(seed)
    if model == "resnet50":
        x = torch.randn(n, 3, shape.image, shape.image, generator=g)
        y = torch.randint(shape.classes, (n,), generator=g)
    else:
        tokens = torch.randint(256, (n, shape.context + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return x.to(device), y.to(device)


def flops_per_sample(model: str, shape: Shape) -> int:
    """FLOPs of one sample's forward, loss and backward, as torch's FlopCounterMode counts them (on the meta device:
    nothing is computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = 2
    with torch.device("meta"):
        net = build(model, shape)
        x, y = pool(model, Shape(**{**asdict(shape), "batch": batch}), batch, "meta")
    with FlopCounterMode(display=False) as counter:
        loss_of(model)(net(x), y).backward()
    return counter.get_total_flops() // batch


# --- data -------------------------------------------------------------------------------------------------------


class DeviceBatches(Dataset):
    """`length` batches drawn at random from samples already on the device (DataLoader(batch_size=None) hands
    them on as they are)."""

    def __init__(self, samples: tuple[Tensor, Tensor], batch: int, length: int) -> None:
        self.x, self.y = samples
        self.batch, self.length = batch, length
        self.generator = torch.Generator(device=self.y.device).manual_seed(0)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(len(self.y), (self.batch,), device=self.y.device, generator=self.generator)
        return self.x[idx], self.y[idx]


class HostSamples(Dataset):
    """`length` samples on the host, cycling through a pool: a DataLoader collates them in its workers."""

    def __init__(self, samples: tuple[Tensor, Tensor], length: int) -> None:
        self.x, self.y = samples
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        j = i % len(self.y)
        return self.x[j], self.y[j]


def host_loader(samples: tuple[Tensor, Tensor], batch: int, batches: int, workers: int, cuda: bool) -> DataLoader:
    return DataLoader(
        HostSamples(samples, batch * batches),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=False,
    )


class PooledTensors(TensorDataset):
    """The template's TensorDataset over `length` samples that cycle through a pool (a few hundred ImageNet-size
    images, not the whole epoch's gigabytes)."""

    def __init__(self, images: Tensor, labels: Tensor, length: int) -> None:
        super().__init__(images, labels)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        device = self.labels.device
        idx = torch.as_tensor(indices).remainder_(len(self.labels)).to(device, non_blocking=device.type == "cuda")
        return self.images[idx], self.labels[idx]

    def to(self, device: torch.device) -> "PooledTensors":
        return PooledTensors(self.images.to(device), self.labels.to(device), self.length)


class _Synthetic(TensorDataModule):
    """A template data module of synthetic samples: `batches` training batches, one of validation and of test.
    Takes (and ignores) the keys of the data config it replaces (`data._target_=gpu_workloads.<class>`)."""

    model = ""

    def __init__(self, batch_size: int, batches: int, pool_size: int, shape: dict, on_device: bool = True, **_: Any):
        super().__init__(batch_size=batch_size, on_device=on_device, shuffle=True)
        self.batches, self.pool_size, self.shape = batches, pool_size, Shape(**dict(shape))

    def load_splits(self) -> dict[str, TensorDataset]:
        x, y = pool(self.model, self.shape, self.pool_size)
        return {
            "train": PooledTensors(x, y, self.batch_size * self.batches),
            "val": PooledTensors(x, y, self.batch_size),
            "test": PooledTensors(x, y, self.batch_size),
        }


class SyntheticImages(_Synthetic):
    model = "resnet50"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes = self.shape.classes  # checked against the model's by the template


class SyntheticTokens(_Synthetic):
    model = "gpt2"
