"""The prediction task: a checkpoint's model on a folder of images, one image or an IDX file, through the module's
own `predict_step` and `trainer.predict`, into <run>/predictions.pt and predictions.csv
(engine.callbacks.predictions)."""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from engine import build
from engine.errors import RunEnded, UserError
from engine.runs.dirs import make_output_dirs
from engine.sweeps import jobs as sweeps
from engine.tasks.numerics import set_matmul_precision
from engine.tasks.seeding import seed_run

log = logging.getLogger(__name__)


def class_names(model: Any, ckpt_path: str, config: dict) -> list[str] | None:
    """A classifier's class names (it has `num_classes`): what the data module saved in the checkpoint (an image
    folder's subfolders), else 0..n-1. None for a module of another task."""
    from engine.runs.full_model import datamodule_state

    count = getattr(model, "num_classes", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    names = datamodule_state(ckpt_path, config).get("classes")
    if isinstance(names, list) and len(names) == count and all(isinstance(n, str) for n in names):
        return names
    return [str(i) for i in range(count)]


def input_spec_of(model: Any, config: dict, cfg: DictConfig) -> Any:
    """What the model takes: its own `input_spec` if it declares one, else its training data's."""
    from engine.data import spec

    return spec.of_module(model) or spec.input_spec(
        config.get("data"), where=f"ckpt_path={cfg.ckpt_path}: data", trusted=cfg.trusted_packages
    )


def _forward_on_images(module: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """The predict_step of a module that defines none: its forward on the batch's images."""
    return module(batch[0])


def _predict_on_images(model: Any) -> None:
    """Lightning's own predict_step hands forward the whole batch, here (images, indices), which no forward takes:
    a module without a predict_step of its own predicts with its forward on the images."""
    import functools

    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("predict_step", model):  # a partial: it pickles with the module (ddp_spawn's workers)
        model.predict_step = functools.partial(_forward_on_images, model)


class PredictRun:
    """`model`: the checkpoint's LightningModule with all its weights (a sharded checkpoint's gathered), in eval mode;
    `inputs`: what `input=` names, read as the model's training data was."""

    def __init__(self, cfg: DictConfig) -> None:
        if cfg.batch_size < 1 or cfg.num_workers < 0:
            raise UserError(f"batch_size={cfg.batch_size}, num_workers={cfg.num_workers}: need >= 1 and >= 0")
        if not Path(cfg.input).expanduser().exists():  # before the checkpoint is read: the cheap mistake first
            raise UserError(
                f"input={cfg.input}: no such file or folder; pass a folder of images, an image or an IDX file"
            )
        from engine.data.inputs import PredictInputs
        from engine.runs.full_model import load_full_model

        seed_run(cfg.seed)
        set_matmul_precision(cfg.float32_matmul_precision)
        self.cfg = cfg
        self.model, train_config = load_full_model(cfg.ckpt_path, cfg.trusted_packages)
        _predict_on_images(self.model)
        self.inputs = PredictInputs(cfg.input, input_spec_of(self.model, train_config, cfg), resize=cfg.resize)
        self._classes = class_names(self.model, cfg.ckpt_path, train_config)
        build.check(cfg)
        make_output_dirs(cfg)
        self.output_dir = Path(cfg.paths.output_dir)

    def trainer(self, trainer_cfg: DictConfig, callbacks: list[Any]) -> Any:
        """The Trainer, with the callback that writes <run>/predictions.pt and predictions.csv (rank 0, in input
        order, whatever the strategy) after `callbacks`."""
        from engine.callbacks.predictions import PredictionsWriter

        writer = PredictionsWriter(self.output_dir, self.inputs.names, self._classes)
        trainer = build.trainer(trainer_cfg, [*callbacks, writer], [], self.cfg.launch, speedups=self.cfg.speedups)
        if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
            sweeps.run_job_in_fresh_process(None)
            raise RunEnded(self.output_dir)
        return trainer

    def dataloader(self, trainer: Any) -> Any:
        """The inputs in batches of `batch_size`, in order."""
        from torch.utils.data import DataLoader

        return DataLoader(
            self.inputs,
            batch_size=self.cfg.batch_size,
            shuffle=False,
            num_workers=self.cfg.num_workers,
            persistent_workers=False,
            pin_memory=trainer.strategy.root_device.type == "cuda",
        )

    def predicted(self, trainer: Any) -> Path:
        if trainer.is_global_zero:
            log.info("Predicted %d inputs into %s", len(self.inputs), self.output_dir)
        return self.output_dir
