"""The prediction task: a checkpoint's model on a folder of images, one image or an IDX file, through
`ImageClassifier.predict_step` and `trainer.predict`, into <run>/predictions.csv."""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from project import build
from project.config.schema import check_config
from project.errors import UserError
from project.launch import sweeps
from project.runs.dirs import make_output_dirs
from project.tasks.numerics import set_matmul_precision
from project.tasks.seeding import seed_run

log = logging.getLogger(__name__)

PREDICTIONS = "predictions.csv"


def class_names(ckpt_path: str, config: dict, num_classes: int) -> list[str]:
    """The class names the data module saved in the checkpoint (an image folder's subfolders), else 0..n-1."""
    from project.runs.full_model import datamodule_state

    names = datamodule_state(ckpt_path, config).get("classes")
    if isinstance(names, list) and len(names) == num_classes and all(isinstance(n, str) for n in names):
        return names
    return [str(i) for i in range(num_classes)]


def _num_classes(model: Any, channels: int, height: int, width: int) -> int:
    import torch

    with torch.no_grad():
        return int(model(torch.zeros(1, channels, height, width)).shape[1])


def predict(cfg: DictConfig) -> Path:
    """Returns the path of the predictions file (written by rank 0)."""
    check_config(cfg)
    if cfg.batch_size < 1 or cfg.num_workers < 0:
        raise UserError(f"batch_size={cfg.batch_size}, num_workers={cfg.num_workers}: need >= 1 and >= 0")
    if not Path(cfg.input).expanduser().exists():  # before the checkpoint is read: the cheap mistake first
        raise UserError(f"input={cfg.input}: no such file or folder; pass a folder of images, an image or an IDX file")
    from torch.utils.data import DataLoader

    from project.callbacks.predictions import PredictionsCSV
    from project.data.inputs import PredictInputs
    from project.data.spec import input_spec
    from project.runs.full_model import load_full_model

    seed_run(cfg.seed)
    set_matmul_precision(cfg.float32_matmul_precision)
    model, train_config = load_full_model(cfg.ckpt_path)
    spec = input_spec(train_config.get("data"), where=f"ckpt_path={cfg.ckpt_path}: data")
    inputs = PredictInputs(cfg.input, spec, resize=cfg.resize)
    classes = class_names(cfg.ckpt_path, train_config, _num_classes(model, spec.channels, spec.height, spec.width))
    build.check(cfg)
    make_output_dirs(cfg)
    output = Path(cfg.paths.output_dir) / PREDICTIONS
    trainer = build.trainer(cfg.trainer, [PredictionsCSV(output, inputs.names, classes)], [], cfg.launch)
    if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
        sweeps.run_job_in_fresh_process(None)
        return output
    loader = DataLoader(
        inputs,
        batch_size=cfg.batch_size,
        shuffle=False,
        num_workers=cfg.num_workers,
        persistent_workers=False,
        pin_memory=trainer.strategy.root_device.type == "cuda",
    )
    trainer.predict(model, dataloaders=loader, return_predictions=False)
    if trainer.is_global_zero:
        log.info("Predicted %d inputs: %s", len(inputs), output)
    return output
