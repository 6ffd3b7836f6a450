"""Weight averaging (`callbacks=[default,ema]`, `[default,swa]`) on Lightning's WeightAveraging, with three fixes:
a test loads the checkpoint's average (Lightning 2.6 reloads `current_model_state` in any stage), the trained weights
stand in until the first update, and strategies that split the model are refused (AveragedModel would zip silently).
"""

import logging
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn

from engine.errors import UserError

log = logging.getLogger(__name__)


def _whole_model_in_each_process(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from engine.strategies.dp import DataParallelStrategy
    from engine.strategies.pipeline_checkpoints import OneCheckpointFile

    if isinstance(strategy, OneCheckpointFile):  # the pipeline: each rank keeps only its stages
        return False
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, DataParallelStrategy))


class _Fixed(WeightAveraging):
    """WeightAveraging with the module's three fixes; until the first update (EMA's update_starting_at_step, SWA's
    start_epoch) the trained weights stand in, not Lightning's copy of the initial ones."""

    name = "weight averaging"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and not _whole_model_in_each_process(trainer.strategy):
            raise UserError(
                f"callbacks.{self.name}: Lightning averages whole models, and {type(trainer.strategy).__name__} "
                "splits this one; use one device or ddp, or drop it from callbacks"
            )
        super().setup(trainer, pl_module, stage)

    def _updated(self) -> bool:
        return self._average_model is not None and int(self._average_model.n_averaged) > 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._updated():  # no update comes between here and the epoch's end: the two swaps pair up
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._updated():
            super().on_validation_epoch_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._updated():
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._updated():
            super().on_train_end(trainer, pl_module)
        else:
            log.warning(
                "callbacks.%s: training ended before the first update of the average; the model and its checkpoints "
                "hold the trained weights, not an average",
                self.name,
            )

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # resuming a checkpoint saved with an average: the average and the raw weights, both. One saved before the
        # first update (or without averaging) holds the weights alone: the average starts at its first update.
        if trainer.state.fn == TrainerFn.FITTING and "averaging_state" in checkpoint:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
        # test, validate, predict: `state_dict`, the average, is loaded already and stays


class EMA(_Fixed, EMAWeightAveraging):
    """Lightning's EMAWeightAveraging: an exponential moving average of the weights, updated every optimizer step.
    Its options spelled out (Lightning's take **kwargs), so that a mistyped one is refused by name at start."""

    name = "ema"

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        device: str | None = None,
        use_buffers: bool = True,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise UserError(f"callbacks.ema.decay={decay!r}: a number in [0, 1), the weight of the old average")
        if update_every_n_steps < 1:
            raise UserError(f"callbacks.ema.update_every_n_steps={update_every_n_steps!r}: at least 1")
        super().__init__(
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
            device=device,
            use_buffers=use_buffers,
        )


class EpochAveraging(_Fixed):
    """SWA: the equal-weight average of the weights at each epoch end from `start_epoch` on; unlike Lightning's older
    StochasticWeightAveraging, checkpoints and tests see the average."""

    name = "swa"

    def __init__(self, start_epoch: int = 1, device: str | None = None, use_buffers: bool = True) -> None:
        if start_epoch < 0:
            raise UserError(f"callbacks.swa.start_epoch={start_epoch!r}: an epoch number from 0 on")
        super().__init__(device=device, use_buffers=use_buffers)
        self.start_epoch = start_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return epoch_idx is not None and epoch_idx >= self.start_epoch


def check_callbacks(callbacks: list[Any]) -> None:
    """One weight averaging at a time: two (callbacks=[default,ema,swa]) would each swap their average into the
    weights the other averages and restores, and the raw weights would be lost."""
    averagers = [c for c in callbacks if isinstance(c, WeightAveraging)]
    if len(averagers) > 1:
        names = " and ".join(f"callbacks.{getattr(c, 'name', type(c).__name__)}" for c in averagers)
        raise UserError(
            f"{names}: two weight averagings of one model, each averaging the other's swapped-in weights; keep one"
        )


def check_resume(ckpt_path: str, checkpoint: dict[str, Any], callbacks: list[Any]) -> None:
    """A checkpoint saved with averaging holds the average as its weights: resumed without that callback, or under
    another averaging, training would silently go on from the wrong weights."""
    if "current_model_state" not in checkpoint:
        return
    mine = [c for c in callbacks if isinstance(c, WeightAveraging)]
    saved = [k for k in checkpoint.get("callbacks") or {} if k in _AVERAGERS]
    if not mine:
        raise UserError(
            f"ckpt_path={ckpt_path}: saved with weight averaging (its weights are the average); resume it with the "
            "callbacks it ran with, e.g. 'callbacks=[default,ema]'"
        )
    if saved and mine[0].state_key not in saved:
        was, now = _AVERAGERS[saved[0]], getattr(mine[0], "name", type(mine[0]).__name__)
        raise UserError(
            f"ckpt_path={ckpt_path}: saved with callbacks.{was}'s average, resumed with callbacks.{now}, which would "
            f"go on from {was}'s state; resume with 'callbacks=[default,{was}]', or start a new run"
        )


_AVERAGERS = {"EMA": "ema", "EpochAveraging": "swa"}  # their checkpoint state's keys -> their config names
