"""In-memory data: each split is one tensor pair, and a batch is one indexing op.

A per-sample Dataset spends more time in Python than a small model spends computing. The DataLoader still iterates
with a sampler, so DDP semantics hold (each rank its own shard, reshuffled per epoch); the dataset answers lists."""

from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from engine.data.resumable import ResumableLoader, ResumableSampler, order_seed


class TensorDataset(Dataset):
    """Images and labels as two tensors; `__getitems__` returns a whole batch in one indexing op."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        # non_blocking on CUDA: a blocking copy would sync the host every step (pageable memory is staged at once);
        # MPS may still read the list later (Lightning copies to MPS blocking for that reason), so there it blocks.
        device = self.labels.device
        idx = torch.as_tensor(indices).to(device, non_blocking=device.type == "cuda")
        return self.images[idx], self.labels[idx]

    def to(self, device: torch.device) -> "TensorDataset":
        return TensorDataset(self.images.to(device), self.labels.to(device))


def _batch_as_is(batch: Any) -> Any:
    """`__getitems__` already returns a batch; a module-level function so ddp_spawn can pickle it."""
    return batch


def normalize(images: Tensor, mean: float, std: float) -> Tensor:
    """uint8 (N, H, W) -> float32 (N, 1, H, W), standardized."""
    return ((images.float() / 255.0 - mean) / std).unsqueeze(1)


def split(n: int, sizes: list[int], seed: int) -> list[Tensor]:
    """A seeded random partition of range(n) into index tensors of the given sizes."""
    if sum(sizes) != n:
        raise ValueError(f"split sizes {sizes} do not add up to {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return list(torch.split(perm, sizes))


class TensorDataModule(L.LightningDataModule):
    """Base for data sets that fit in memory: subclasses fill `self.splits` in `load_splits`. `shuffle=false`: a fixed
    order, for exact comparisons; `on_device`: the tensors move to the accelerator once, no batch is copied after."""

    num_classes: int | None = None  # how many classes its labels have, where it knows: checked against the model

    def __init__(self, batch_size: int = 64, on_device: bool = True, shuffle: bool = True) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.on_device = on_device
        self.shuffle = shuffle
        self.splits: dict[str, TensorDataset] = {}
        self._seed: int | None = None

    def load_splits(self) -> dict[str, TensorDataset]:
        """Return the 'train', 'val' and 'test' splits, read from disk (never downloaded: see prepare_data)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        splits = self.load_splits()
        if self.on_device and self.trainer is not None:
            device = self.trainer.strategy.root_device
            if device.type != "cpu":
                splits = {name: ds.to(device) for name, ds in splits.items()}
        self.splits = splits

    def _shard(self) -> dict[str, Any]:
        """This process's part of each epoch: one of world_size interleaved shards (the whole, on one device)."""
        trainer = self.trainer
        if trainer is None or trainer.world_size < 2:
            return {"num_replicas": 1, "rank": 0}
        return dict(trainer.strategy.distributed_sampler_kwargs)  # type: ignore[attr-defined]

    def _order_seed(self) -> int:
        if self._seed is None:
            self._seed = order_seed(self.trainer)
        return self._seed

    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        dataset = self.splits[name]
        # num_workers=0: the tensors may live on the GPU, and indexing them is faster than any worker IPC.
        if name != "train":  # shared among processes by engine.callbacks.eval_shards, each sample once
            return DataLoader(dataset, batch_size=self.batch_size, collate_fn=_batch_as_is)
        # One seeded permutation per epoch, cut into shards: on one device or N, the global batches are the
        # same. (Lightning's own sampler for ddp would also always shuffle, ignoring shuffle=false.)
        seed = self._order_seed() if shuffle else 0
        sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, **self._shard())
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=_batch_as_is)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
