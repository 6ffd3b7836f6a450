"""A training loader that a checkpoint saved mid-epoch continues exactly: same order, next batch.

Lightning checkpoints the DataLoader's `state_dict` (never its sampler's), so the position and the order's seed
(drawn afresh under seed=null) live here. The loader's own generator keeps `iter()` off the global random state."""

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from engine.errors import UserError


class ResumableSampler(DistributedSampler):
    """A DistributedSampler (Lightning keeps it under ddp as it is) that can skip a prefix of one epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0  # samples of this rank's shard to leave out, once

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """Counts the batches it yields; `state_dict` / `load_state_dict` are what Lightning checkpoints."""

    sampler: ResumableSampler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["generator"] = torch.Generator()
        super().__init__(*args, **kwargs)
        self._epoch: int | None = None
        self._yielded = 0
        self._resume: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's iterator class
        # A generator: its body runs at the first next(), after Lightning's set_epoch for this epoch.
        sampler, skip = self.sampler, 0
        if not isinstance(sampler, ResumableSampler):  # Lightning swapped it (overfit_batches): plain iteration
            yield from super().__iter__()
            return
        if self._resume is not None and self._resume["epoch"] == sampler.epoch:
            skip = self._resume["batches"]
            sampler.skip = skip * int(self.batch_size or 1)
        self._resume = None
        self._epoch, self._yielded = sampler.epoch, skip
        assert self.generator is not None
        self.generator.manual_seed(sampler.seed + sampler.epoch)
        for batch in super().__iter__():
            self._yielded += 1  # counted when handed over: right even when workers prefetch
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": -1 if self._epoch is None else self._epoch,
            "batches": self._yielded,
            "seed": self.sampler.seed,
            "batch_size": int(self.batch_size or 1),
            "samples": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("batches") and state.get("epoch", -1) >= 0:  # saved mid-epoch: its position is in batches
            was = (state.get("batch_size"), state.get("samples"))
            now = (int(self.batch_size or 1), len(self.dataset))  # type: ignore[arg-type]
            if was[0] is not None and was != now:
                raise UserError(
                    f"the checkpoint was saved after batch {state['batches']} of an epoch of {was[1]} training "
                    f"samples in batches of {was[0]}; this run's loader has {now[1]} in batches of {now[0]}, where "
                    "that position means other samples: resume with the data settings it was saved with (data.*), "
                    "or from a checkpoint saved at an epoch's end"
                )
        self._resume = dict(state)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.seed = int(state.get("seed", self.sampler.seed))


def order_seed(trainer: Any) -> int:
    """The seed of the training order: the run's, or (seed=null) one drawn by rank 0 and shared, so that the ranks'
    shards still split one permutation."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    drawn = int(seed) if seed is not None else int.from_bytes(os.urandom(4), "little")
    return int(trainer.strategy.broadcast(drawn)) if trainer is not None and trainer.world_size > 1 else drawn
