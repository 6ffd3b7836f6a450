"""Stochastic weight averaging on Lightning's WeightAveraging, so that it is saved and resumed like EMA."""

from typing import Any

from lightning.pytorch.callbacks import WeightAveraging


class EpochAveraging(WeightAveraging):
    """The equal-weight average (WeightAveraging's default) of the weights at each epoch end from `start_epoch` on.

    Lightning's older StochasticWeightAveraging callback swaps in a learning-rate schedule of its own; this one
    leaves the run's schedule alone and keeps its state in the checkpoint (averaging_state)."""

    def __init__(self, start_epoch: int = 1, **kwargs: Any) -> None:
        if not isinstance(start_epoch, int) or start_epoch < 0:
            raise ValueError(f"callbacks.swa.start_epoch={start_epoch!r}: an epoch number from 0 on")
        super().__init__(**kwargs)
        self.start_epoch = start_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return epoch_idx is not None and epoch_idx >= self.start_epoch
