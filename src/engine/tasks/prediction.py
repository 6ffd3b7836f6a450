"""What a prediction needs around the user's task (project.tasks.predict): the checkpoint's model, and what to
predict on: the checkpoint's own DataModule's predict_dataloader (any task: rows of a table, prompts of a text
model, ...), or with `input=` images for a model of images. The module's own `predict_step` runs through
`trainer.predict`; engine.callbacks.predictions writes <run>/predictions.pt and predictions.csv."""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine import build
from engine.console import show_start
from engine.errors import RunEnded, UserError
from engine.runs import checkpoints
from engine.runs.dirs import make_output_dirs
from engine.sweeps import jobs as sweeps
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


def batch_input(batch: Any) -> Any:
    """A batch's inputs: its "input" entry, its first item, or the batch itself."""
    return batch["input"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch


def _forward_on_inputs(module: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """The predict_step of a module that defines none: its forward on the batch's inputs."""
    return module(batch_input(batch))


def _predict_with_forward(model: Any) -> None:
    """Lightning's own predict_step hands forward the whole batch, here {"input": ..., "name": ...}, which no forward
    takes: a module without a predict_step of its own predicts with its forward on the inputs."""
    import functools

    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("predict_step", model):  # a partial: it pickles with the module (ddp_spawn's workers)
        model.predict_step = functools.partial(_forward_on_inputs, model)


def _data_config(cfg: DictConfig, train_config: dict) -> DictConfig:
    """The checkpoint's data config, with this command's `data.<key>=...` over it where not null (what to predict on:
    predict.yaml lists the template's keys as null)."""
    stored = train_config.get("data")
    if not isinstance(stored, dict):
        raise UserError(f"ckpt_path={cfg.ckpt_path}: holds no data config to predict with; pass input=<images>")
    checkpoints.check_buildable(stored, "data", kind="data", trusted=cfg.trusted_packages)
    given = {key: value for key, value in (cfg.data or {}).items() if value is not None}
    merged = OmegaConf.merge(OmegaConf.create(stored), OmegaConf.create(given))
    build.check_options(merged, "data")
    return merged  # type: ignore[return-value]


def _check_predict_data(datamodule: Any) -> None:
    """The DataModule's predict_dataloader made once before any process starts, so a value it refuses is one line, not
    a traceback from inside Lightning's loop."""
    try:
        datamodule.setup("predict")
        datamodule.predict_dataloader()
    except (ValueError, OSError) as e:
        reason = " ".join(str(e).split())
        raise UserError(f"data: {type(e).__name__}: {reason}") from e


class PredictRun:
    """`model`: the checkpoint's whole LightningModule, in eval mode. `datamodule`: with `input=`, those images read as
    the training data was; else the checkpoint's DataModule, this command's `data.<key>=...` over it."""

    def __init__(self, cfg: DictConfig) -> None:
        if cfg.batch_size < 1 or cfg.num_workers < 0:
            raise UserError(f"batch_size={cfg.batch_size}, num_workers={cfg.num_workers}: need >= 1 and >= 0")
        if cfg.input is not None and not Path(cfg.input).expanduser().exists():  # the cheap mistake first
            raise UserError(
                f"input={cfg.input}: no such file or folder; pass a folder of images, an image or an IDX file"
            )
        from engine.runs.full_model import datamodule_state, load_full_model

        seed_run(cfg.seed, cfg.float32_matmul_precision)
        self.cfg = cfg
        self.model, train_config = load_full_model(cfg.ckpt_path, cfg.trusted_packages)
        _predict_with_forward(self.model)
        self._classes = class_names(self.model, cfg.ckpt_path, train_config)
        if cfg.input is not None:
            from engine.data.inputs import ImageInputs, PredictInputs

            inputs = PredictInputs(cfg.input, input_spec_of(self.model, train_config, cfg), resize=cfg.resize)
            self.datamodule: Any = ImageInputs(inputs, cfg.batch_size, cfg.num_workers)
        else:
            self.datamodule = build.instantiate(_data_config(cfg, train_config), "data")
            from lightning.pytorch.utilities.model_helpers import is_overridden

            if not is_overridden("predict_dataloader", self.datamodule):
                raise UserError(
                    f"{type(self.datamodule).__name__} has no predict_dataloader to say what to predict on: give it "
                    "one (docs: your data), or pass input=<images> for a model of images"
                )
            state = datamodule_state(cfg.ckpt_path, train_config)
            if state and callable(getattr(self.datamodule, "load_state_dict", None)):
                self.datamodule.load_state_dict(state)  # what it learned in training (a table's statistics)
            _check_predict_data(self.datamodule)
        build.check(cfg)
        make_output_dirs(cfg)
        self.output_dir = Path(cfg.paths.output_dir)

    def trainer(self, trainer_cfg: DictConfig, callbacks: list[Any]) -> Any:
        """The Trainer, with the callback that writes <run>/predictions.pt and predictions.csv (rank 0, in input
        order, whatever the strategy) after `callbacks`."""
        from engine.callbacks.predictions import PredictionsWriter

        writer = PredictionsWriter(self.output_dir, self._classes)
        trainer = build.trainer(trainer_cfg, [*callbacks, writer], [], self.cfg.launch, speedups=self.cfg.speedups)
        if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
            sweeps.run_job_in_fresh_process(None)
            raise RunEnded(self.output_dir)
        show_start(self.cfg, self.output_dir)
        return trainer

    def predicted(self, trainer: Any) -> Path:
        if trainer.is_global_zero:
            log.info("Predictions in %s", self.output_dir)
        return self.output_dir
