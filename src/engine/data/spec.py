"""What a model trained on some data expects as input, read from the data config a checkpoint stores.

predict.py converts images to it and export.py embeds its normalization, so both need it without the data itself
(an image folder on another machine, MNIST not downloaded here): only the config is read."""

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import UserError
from engine.runs import checkpoints

MAX_SIDE = 8192
MAX_PIXELS = MAX_SIDE * MAX_SIDE  # the largest image a model here takes (a 256 MB uint8 RGB image)


@dataclass(frozen=True)
class InputSpec:
    """Images of `channels` x `height` x `width`, pixels scaled to [0, 1], then standardized per channel."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise ValueError(f"channels={self.channels}: images are grey (1) or RGB (3)")
        if min(self.height, self.width) < 1:
            raise ValueError(f"image size {self.height}x{self.width}: must be at least 1x1")
        if self.height * self.width > MAX_PIXELS:  # a config (or a checkpoint's) cannot make predict allocate GBs
            raise ValueError(f"image size {self.height}x{self.width}: larger than {MAX_SIDE}x{MAX_SIDE} pixels")
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) != self.channels:
                raise ValueError(f"{name}={list(values)}: one value per channel ({self.channels})")
        if min(self.std) <= 0:
            raise ValueError(f"std={list(self.std)}: must be positive")


def of_module(module: Any) -> InputSpec | None:
    """What a LightningModule says it takes, if it says so: an `input_spec` attribute or method
    (docs/your-model.md); it comes before the data's."""
    spec = getattr(module, "input_spec", None)
    spec = spec() if callable(spec) else spec
    if spec is not None and not isinstance(spec, InputSpec):
        raise UserError(f"{type(module).__name__}.input_spec: must be a engine.data.spec.InputSpec, got {spec!r}")
    return spec


def images_of(data: Any, where: str = "data", trusted: Sequence[str] = ()) -> InputSpec | None:
    """What the images of the data module `data` look like, or None for data that says nothing of images (rows of
    a table, text): its modules have no `input_spec`."""
    if not isinstance(data, dict) or not isinstance(data.get("_target_"), str):
        return None
    checkpoints.check_buildable(data, where, kind="data", trusted=trusted)
    import hydra

    if not inspect.ismethod(getattr(hydra.utils.get_class(data["_target_"]), "input_spec", None)):
        return None
    return input_spec(data, where, trusted)


def input_spec(data: Any, where: str = "data", trusted: Sequence[str] = ()) -> InputSpec:
    """The input of a model trained on the data module `data` (a plain config dict, as a checkpoint holds).
    Data modules of images say it themselves with a classmethod `input_spec(config: dict) -> InputSpec`."""
    if not isinstance(data, dict) or not isinstance(data.get("_target_"), str):
        raise UserError(f"{where}: holds no data config, so the model's input size and normalization are unknown")
    checkpoints.check_buildable(data, where, kind="data", trusted=trusted)  # imports nothing outside those
    target = data["_target_"]
    import hydra

    cls = hydra.utils.get_class(target)
    method = getattr(cls, "input_spec", None)
    if not inspect.ismethod(method):
        raise UserError(
            f"{where}._target_={target}: its inputs are not images that input= can read (it has no classmethod "
            "`input_spec(config) -> engine.data.spec.InputSpec`); predict on what its DataModule's "
            "predict_dataloader gives instead: leave out input= (and set what to predict on: data.<key>=...)"
        )
    try:
        return method(data)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {type(e).__name__}: {e}") from e
