"""Any DataModule's training loader, made resumable mid-epoch and ordered alike on one device or many: Lightning
cannot resume a plain shuffled loader mid-epoch, and under ddp its DistributedSampler draws another order (and
ignores shuffle=False). torchdata's StatefulDataLoader gives the position but not the order (empty or replayed epochs).
"""

import logging
from typing import Any

import lightning.pytorch as L
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from engine.data.resumable import ResumableLoader, ResumableSampler, order_seed

log = logging.getLogger(__name__)

# DataLoader arguments carried over as the user set them (the sampler and its batching are replaced)
KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _left_as_is(loader: Any) -> str | None:
    """Why a training loader cannot be remade here, or None when it can."""
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a DataLoader"
    if callable(getattr(loader, "state_dict", None)):
        return ""  # resumable already (ours, torchdata's, a user's own): nothing to say
    if isinstance(loader.dataset, IterableDataset):
        return "an iterable data set (its order is its own)"
    if type(loader.batch_sampler) is not BatchSampler or loader.batch_size is None:
        return "a batch sampler of its own"
    sampler = loader.sampler
    plain = type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source)
    )
    return None if plain else f"a sampler of its own ({type(sampler).__name__})"


class ResumableData(L.Callback):
    """See the module docstring. In conf/callbacks/checkpoints.yaml, beside the checkpoints it makes exact."""

    def __init__(self) -> None:
        self._seed: int | None = None
        self._wrapped: Any = None  # the DataModule whose train_dataloader this callback answers
        self._loader: tuple[str | None, int, bool] | None = None  # why left as is; workers; persistent workers

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """What a resume cannot give back exactly is said, not left silent."""
        loader, self._loader = self._loader, None
        if not trainer.ckpt_path or loader is None or not trainer.is_global_zero:
            return
        why, workers, persistent = loader
        done = getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0)
        mid_epoch = trainer.fit_loop.restarting and done > 0
        if why and mid_epoch:
            log.warning(
                "Resumed after batch %d of an epoch, with a training loader that cannot continue there (%s): the epoch "
                "starts its order over, and its first batches come twice",
                done,
                why,
            )
        elif why:  # its draws follow no seed of ours: even at an epoch's end the order may not be the unbroken run's
            log.warning(
                "Resumed with a training loader left as it is (%s): its order may not be the unbroken run's", why
            )
        if workers and (mid_epoch or persistent):
            log.warning(
                "Resumed with %d loader workers: random draws inside them (augmentation in a Dataset or collate_fn) "
                "start from new states, so the run is not bit for bit the unbroken one (docs: Fault tolerance)",
                workers,
            )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if stage != "fit" or datamodule is None or "train_dataloader" in vars(datamodule):
            return
        original = datamodule.train_dataloader

        def train_dataloader() -> Any:
            return self._resumable(original(), trainer)

        datamodule.train_dataloader = train_dataloader  # an instance attribute, taken back at teardown
        self._wrapped = datamodule

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            vars(self._wrapped).pop("train_dataloader", None)
            self._wrapped = None

    def _order_seed(self, trainer: L.Trainer) -> int:  # kept in every checkpoint by the loader
        if self._seed is None:
            self._seed = order_seed(trainer)
        return self._seed

    def _resumable(self, loader: Any, trainer: L.Trainer) -> Any:
        why = _left_as_is(loader)
        workers = getattr(loader, "num_workers", 0)
        self._loader = (why, workers, bool(workers and getattr(loader, "persistent_workers", False)))
        if why is not None:
            if why and trainer.is_global_zero:
                log.info("The training loader is left as it is (%s): a resume starts its epoch over", why)
            return loader
        shards = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer.world_size > 1 else None
        shuffle = isinstance(loader.sampler, RandomSampler)
        sampler = ResumableSampler(
            loader.dataset,
            shuffle=shuffle,
            seed=self._order_seed(trainer) if shuffle else 0,
            **(shards or {"num_replicas": 1, "rank": 0}),
        )
        kept = {name: getattr(loader, name) for name in KEPT}
        if loader.num_workers > 0:
            kept["prefetch_factor"] = loader.prefetch_factor
        return ResumableLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, **kept)
