"""Text as bytes: windows of `block_size` bytes and, one byte on, the bytes that follow them. From a text file of
yours, or by default from the Python documentation's topics that ship with Python itself (pydoc_data, 450 kB of
English and code: nothing to download). The worked example of data that is not images: `data=text`.

predict.py continues prompts: `python predict.py ckpt_path=... data.prompts='["def ", "The "]'`, or one prompt per
line of a file: data.predict_path=prompts.txt.
"""

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


def read_text(path: str | None) -> bytes:
    """The file's bytes, or the Python documentation's topics."""
    if path is not None:
        return Path(path).expanduser().read_bytes()
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


class Windows(Dataset):
    """Non-overlapping windows: input bytes [i*B, (i+1)*B) and target bytes one further on."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Prompts(Dataset):
    def __init__(self, prompts: list[str]) -> None:
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        encoded = torch.tensor(list(self.prompts[i].encode("utf-8")), dtype=torch.long)
        return {"input": encoded, "name": self.prompts[i]}


class TextDataModule(L.LightningDataModule):
    """The first 90% of the text (its first `max_bytes`, when given) for training, the rest for validation and
    test; `block_size` must not exceed the model's."""

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 32,
        max_bytes: int | None = None,
        shuffle: bool = True,
        prompts: list[str] | None = None,
        predict_path: str | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1 or (max_bytes is not None and max_bytes < 2 * block_size + 2):
            raise ValueError(f"block_size, batch_size >= 1 and max_bytes >= 2 windows: {block_size}, {batch_size}")
        self.path, self.block_size, self.batch_size, self.max_bytes = path, block_size, batch_size, max_bytes
        self.shuffle, self.prompts, self.predict_path = shuffle, list(prompts or []), predict_path

    def setup(self, stage: str) -> None:
        if stage == "predict":
            return
        text = read_text(self.path)[: self.max_bytes]
        if not text:
            raise ValueError(f"data.path={self.path}: an empty file; give it text to learn from")
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(0.9 * len(data))
        self.train_set, self.val_set = Windows(data[:cut], self.block_size), Windows(data[cut:], self.block_size)
        if not len(self.train_set) or not len(self.val_set):
            raise ValueError(f"{len(data)} bytes: too few for windows of block_size={self.block_size} in both splits")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """One prompt a batch (prompts differ in length): data.prompts, then the lines of data.predict_path."""
        prompts = list(self.prompts)
        if self.predict_path is not None:
            prompts += [line for line in Path(self.predict_path).expanduser().read_text().splitlines() if line]
        if not prompts:
            raise ValueError("nothing to continue: pass data.prompts='[\"...\"]' or data.predict_path=<file>")
        if not all(prompts):
            raise ValueError("data.prompts: an empty prompt; give each at least one character to continue")
        return DataLoader(Prompts(prompts), batch_size=1)
