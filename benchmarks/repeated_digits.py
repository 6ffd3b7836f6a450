"""The default digits with the training split repeated k times, for "how does epoch time grow with data size":
`data._target_=repeated_digits.RepeatedDigits +data.repeat=4` (benchmarks/ on PYTHONPATH)."""

from typing import Any

from engine.data.tensors import TensorDataset
from project.data.digits import DigitsDataModule


class RepeatedDigits(DigitsDataModule):
    """DigitsDataModule whose training split is its 3,500 digits `repeat` times over; val and test unchanged,
    so only the training part of an epoch grows."""

    def __init__(self, repeat: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        self.repeat = repeat

    def load_splits(self) -> dict[str, TensorDataset]:
        splits = super().load_splits()
        train = splits["train"]
        splits["train"] = TensorDataset(train.images.repeat(self.repeat, 1, 1, 1), train.labels.repeat(self.repeat))
        return splits
