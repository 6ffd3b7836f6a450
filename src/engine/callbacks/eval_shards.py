"""Under several processes, every validation and test sample scored once, as on one device. Lightning's (and torch's)
DistributedSampler pads the last shards with repeated samples so that the ranks run as many batches: a set the ranks
do not divide was scored with some samples twice. Here each rank takes every world_size-th sample, unpadded, and the
batch size drops (rarely, by a few) to the largest at which every shard still makes as many batches. Predictions
are sharded padded instead (equal shards, as many batches, as fsdp's collective forward needs, at any size): the
engine's PredictionsWriter drops the repeated inputs.
"""

import logging
from collections.abc import Sized
from typing import Any

import lightning.pytorch as L
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from engine.callbacks.resumable_data import KEPT

log = logging.getLogger(__name__)
_LOADERS = {"val_dataloader": "validation", "test_dataloader": "test", "predict_dataloader": "prediction"}


def even_batch_size(total: int, ranks: int, batch_size: int) -> int | None:
    """The largest size up to `batch_size` at which shards of total // ranks samples and of one more make as many
    batches (ceil(s / b) == ceil((s + 1) / b) exactly when b does not divide s); None where none does."""
    if total % ranks == 0:
        return batch_size
    short = total // ranks
    return next((size for size in range(batch_size, 1, -1) if short % size), None)


class EvalShards(L.Callback):
    """See the module docstring. In conf/callbacks/eval_shards.yaml; a loader with a sampler or batching of its own
    is left to Lightning."""

    def __init__(self) -> None:
        self._wrapped: Any = None  # the DataModule whose val/test_dataloader this callback answers

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if trainer.world_size < 2 or datamodule is None:
            return
        for name, split in _LOADERS.items():
            if name not in vars(datamodule) and hasattr(datamodule, name):
                original = getattr(datamodule, name)

                def sharded(original: Any = original, split: str = split) -> Any:
                    loaders = original()
                    if isinstance(loaders, CombinedLoader):  # its DataLoaders, which Lightning would shard padded
                        loaders.flattened = [self._sharded(each, trainer, split) for each in loaders.flattened]
                        return loaders
                    return apply_to_collection(loaders, DataLoader, self._unpadded, trainer, split)

                setattr(datamodule, name, sharded)  # instance attributes, taken back at teardown
        self._wrapped = datamodule

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            for name in _LOADERS:
                vars(self._wrapped).pop(name, None)
            self._wrapped = None

    def _sharded(self, loader: Any, trainer: L.Trainer, split: str) -> Any:
        return self._unpadded(loader, trainer, split) if isinstance(loader, DataLoader) else loader

    def _unpadded(self, loader: DataLoader, trainer: L.Trainer, split: str) -> DataLoader:
        shards = dict(getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1})
        ranks = int(shards["num_replicas"])
        if ranks < 2 or isinstance(loader.dataset, IterableDataset) or not isinstance(loader.dataset, Sized):
            return loader
        if isinstance(loader.sampler, UnrepeatedDistributedSampler):  # ours already: test_dataloader returning val's
            return loader
        total = len(loader.dataset)
        plain = type(loader.sampler) is SequentialSampler and type(loader.batch_sampler) is BatchSampler
        if not plain or loader.batch_size is None or loader.drop_last:
            sampled = len(loader.sampler) if isinstance(loader.sampler, Sized) else total  # a subset's own length
            if trainer.is_global_zero and split != "prediction" and (sampled % ranks or loader.drop_last):
                dropping = ", drop_last" if loader.drop_last else ""
                log.warning(
                    f"The {split} loader has a sampler or batching of its own ({type(loader.batch_sampler).__name__}"
                    f" over {type(loader.sampler).__name__}{dropping}): Lightning shares it among {ranks} ranks and "
                    f"may repeat or leave out some of its samples, which makes the {split} numbers differ from one "
                    "device's"
                )
            return loader
        kept = {name: getattr(loader, name) for name in KEPT}
        if loader.num_workers > 0:
            kept["prefetch_factor"] = loader.prefetch_factor
        if split == "prediction":  # padded: Lightning's unpadded shards may run different numbers of batches
            padded: DistributedSampler = DistributedSampler(loader.dataset, shuffle=False, **shards)
            return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=padded, **kept)
        size = even_batch_size(total, ranks, loader.batch_size)
        if size is None:
            if trainer.is_global_zero:
                log.warning(
                    f"The {split} set's {total} samples cannot be shared by {ranks} ranks in batches of "
                    f"{loader.batch_size} without a rank running one batch more: Lightning repeats "
                    f"{ranks - total % ranks} of them, and the {split} numbers count those twice"
                )
            return loader
        if size != loader.batch_size and trainer.is_global_zero:
            log.info(f"The {split} set in batches of {size}, not {loader.batch_size}: every rank runs as many")
        sampler = UnrepeatedDistributedSampler(loader.dataset, shuffle=False, **shards)
        return DataLoader(loader.dataset, batch_size=size, sampler=sampler, **kept)
