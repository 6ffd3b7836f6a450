"""`tune=lr|batch_size`: Lightning's learning-rate and batch-size finders, on a Trainer of their own.

The finder runs before the run's own Trainer exists, on one device, and leaves nothing but its report in the run
dir: tune.json (the value found, the override that uses it, the curve) and, for the learning rate, lr_find.png.
With `tune.apply=true` the value is written into the config (the run's config and HParams show it) and the model
or data are built again from it, seeded as the run was: the run then trains as `python train.py <override>` would.
"""

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from project import build
from project.errors import UserError
from project.launch import sweeps
from project.runs.atomic_io import write_file

log = logging.getLogger(__name__)

FIX = "free space on the disk of paths.log_dir, or point paths.log_dir elsewhere"
UNLIMITED = {"max_epochs": -1, "max_time": None}
LR_KEYS = ("model.optimizer.lr", "model.lr", "model.learning_rate")  # where the template's and users' models keep it


def config_key(cfg: DictConfig) -> str:
    """The config key the value found belongs to: `tune.key`, else the first of the usual places that exists."""
    if cfg.tune.key:
        if OmegaConf.select(cfg, cfg.tune.key) is None:
            raise UserError(f"tune.key={cfg.tune.key}: no such key in this config; name the key of your model's value")
        return cfg.tune.key
    if cfg.tune.mode == "batch_size":
        return "data.batch_size"
    for key in LR_KEYS:
        if OmegaConf.select(cfg, key) is not None:
            return key
    raise UserError(f"tune=lr: none of {', '.join(LR_KEYS)} is in this config; set tune.key=<your model's lr key>")


def check(cfg: DictConfig) -> None:
    """What the finders cannot do, said before anything is built."""
    if cfg.tune.mode not in ("lr", "batch_size"):
        raise UserError(f"tune.mode={cfg.tune.mode!r}: lr or batch_size (tune=lr, tune=batch_size)")
    t = cfg.tune
    if t.mode == "lr" and not (0 < t.min_lr < t.max_lr and t.num_training >= 20):
        raise UserError(
            f"tune.min_lr={t.min_lr}, tune.max_lr={t.max_lr}, tune.num_training={t.num_training}: the finder needs "
            "0 < min_lr < max_lr and at least 20 steps"
        )
    if t.mode == "batch_size" and min(t.init_val, t.max_trials, t.steps_per_trial) < 1:
        raise UserError(
            f"tune.init_val={t.init_val}, tune.max_trials={t.max_trials}, tune.steps_per_trial={t.steps_per_trial}: "
            "each at least 1"
        )
    if sweeps.is_multirun():
        raise UserError("tune: Lightning's finders tune one run; run it without -m, then sweep with the value found")
    if cfg.ckpt_path:
        raise UserError("tune with ckpt_path: the finders tune a fresh model; tune first, then train and resume")
    if not cfg.train:
        raise UserError("tune with train=false: the finders train; drop train=false")
    config_key(cfg)


def _tuning_trainer(cfg: DictConfig, scratch: Path) -> Any:
    """A Trainer like the run's, on one device, without the run's loggers, callbacks and checkpoints."""
    trainer = build.trainer(
        # the finders count their own steps: the run's epoch and time limits would cut them short
        OmegaConf.create({**_plain(cfg.trainer), "default_root_dir": str(scratch), **UNLIMITED}),
        [],
        [],
        cfg.launch,
        cfg.checks.every_n_steps,
        None,
    )
    if trainer.world_size > 1 or trainer.strategy.__class__.__name__ not in ("SingleDeviceStrategy",):
        raise UserError(
            f"tune={cfg.tune.mode}: Lightning's finders run on one device, not under "
            f"{trainer.strategy.__class__.__name__} with {trainer.world_size} processes; add trainer=default"
        )
    return trainer


def _plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def find(cfg: DictConfig, model: Any, datamodule: Any, output_dir: Path) -> dict[str, Any]:
    """Run the finder; write tune.json (and lr_find.png); return the report."""
    from lightning.pytorch.tuner import Tuner

    key = config_key(cfg)
    scratch = output_dir / ".tune"
    trainer = _tuning_trainer(cfg, scratch)
    tuner = Tuner(trainer)
    try:
        if cfg.tune.mode == "lr":
            finder: Any = tuner.lr_find(
                model,
                datamodule=datamodule,
                min_lr=cfg.tune.min_lr,
                max_lr=cfg.tune.max_lr,
                num_training=cfg.tune.num_training,
                update_attr=False,
            )
            if finder is None:
                raise UserError("tune with trainer.fast_dev_run: Lightning skips the finders then; drop fast_dev_run")
            value = finder.suggestion()
            curve = {"lr": [float(x) for x in finder.results["lr"]], "loss": [float(x) for x in finder.results["loss"]]}
            if value is None:
                raise UserError(
                    f"tune=lr: no suggestion from {len(curve['lr'])} steps (it needs a loss that falls over enough of "
                    "them); raise tune.num_training or widen tune.min_lr..tune.max_lr"
                )
            figure: Any = finder.plot(suggest=True)
            write_file(output_dir / "lr_find.png", lambda path: figure.savefig(path, format="png", dpi=100), FIX)
        else:
            found: Any = tuner.scale_batch_size(
                model,
                datamodule=datamodule,
                mode="power",
                init_val=cfg.tune.init_val,
                max_trials=cfg.tune.max_trials,
                steps_per_trial=cfg.tune.steps_per_trial,
            )
            if found is None:
                raise UserError("tune with trainer.fast_dev_run: Lightning skips the finders then; drop fast_dev_run")
            value, curve = found, {}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # Lightning's own temporary checkpoint of the model
    value = float(f"{value:.3g}") if cfg.tune.mode == "lr" else int(value)  # what the printed override says
    report = {"mode": cfg.tune.mode, "key": key, "value": value, "override": f"{key}={value}", **curve}
    write_file(output_dir / "tune.json", lambda path: path.write_text(json.dumps(report, indent=2) + "\n"), FIX)
    return report


def apply(cfg: DictConfig, report: dict[str, Any]) -> None:
    """Write the value into the config the rest of the run is built from."""
    OmegaConf.update(cfg, report["key"], report["value"])
