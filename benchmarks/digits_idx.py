"""The template's 5,000 default digits written as MNIST's IDX files, so that code which reads MNIST from disk
(torchvision's `MNIST`, the lightning-hydra-template) works on exactly the same images, offline."""

import struct
from pathlib import Path

from project.data.digits import read_mnist_5k

TRAIN_DIGITS = 4000  # the first 4,000 as MNIST's "train" file, the last 1,000 as its "t10k" file


def write_digits_idx(root: Path) -> Path:
    """Writes <root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (big-endian magic and sizes, then
    uint8 data: torchvision's reader) and returns <root>. Shuffled first: the file is sorted by class."""
    import torch

    images, labels = read_mnist_5k()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = images[order].numpy(), labels[order].numpy().astype("uint8")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, part in (("train", slice(0, TRAIN_DIGITS)), ("t10k", slice(TRAIN_DIGITS, None))):
        imgs, labs = images[part], labels[part]
        header = struct.pack(">IIII", 2051, len(imgs), 28, 28)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + imgs.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, len(labs)) + labs.tobytes())
    return root
