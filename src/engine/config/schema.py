"""Typed top level of train.yaml, eval.yaml, predict.yaml and export.yaml: Hydra rejects unknown keys and wrong types
at compose time. Groups are typed by their `_target_` (engine.build checks them); what a type cannot say is
checked by `check_config`, first thing in every task.
"""

import os
import stat
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from engine.errors import UserError

# What a missing mandatory key means to a user.
_REQUIRED_HINTS = {
    "ckpt_path": "pass the checkpoint to use: ckpt_path=<run>/checkpoints/last.ckpt",
    "input": "pass what to predict: input=<folder of images | image | IDX file>",
}
SEED_RANGE = (0, 2**32 - 1)  # what numpy, and so Lightning's seed_everything, accepts
MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class LaunchConfig:
    """How processes are started and meet: settings of this project, not of Lightning's Trainer."""

    allow_oversubscribe: bool = False  # more CPU processes than cores: refused unless true
    rendezvous_timeout_s: int = 300  # how long ranks wait for each other (other nodes) before giving up


@dataclass
class MonitorConfig:
    """The metric that judges a run: best checkpoint, early stopping, sweeps, Optuna, the plateau scheduler."""

    metric: str = "val/acc"  # logged by the module in validation
    mode: str = "max"  # max: higher is better; min: lower is better


MONITOR_MODES = ("max", "min")


@dataclass
class RunConfig:
    """What every entry point's config has."""

    task_name: str = MISSING
    seed: Optional[int] = None
    trainer: Any = MISSING
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    float32_matmul_precision: str = "high"
    paths: PathsConfig = field(default_factory=PathsConfig)
    # packages of yours whose classes a checkpoint may name, besides this project's, torch.nn, torch.optim and
    # torchvision.models (engine.runs.checkpoints): a checkpoint may come from someone else
    trusted_packages: list[str] = field(default_factory=list)
    # the engine's shortcuts through Lightning's per-step bookkeeping and the interpreter's teardown (engine.build)
    speedups: bool = True
    print_config: bool = True  # the composed config as a tree on the console at start


@dataclass
class TuneConfig:
    """`tune=lr|batch_size`: Lightning's finders before training (engine.tasks.tune)."""

    mode: str = MISSING  # lr | batch_size
    apply: bool = False  # train with the value found (else stop after tuning and say the override)
    key: Optional[str] = None  # the config key of the value; None: model.optimizer.lr, model.lr, ... / data.batch_size
    min_lr: float = 1e-6
    max_lr: float = 1.0
    num_training: int = 100  # steps of the learning-rate sweep
    init_val: int = 2  # the batch size the batch-size finder starts from, doubled each trial
    max_trials: int = 6
    max_val: int = 8192  # the largest batch size the batch-size finder tries
    steps_per_trial: int = 3


@dataclass
class TrainConfig(RunConfig):
    task_name: str = "train"
    train: bool = True
    test: bool = True
    ckpt_path: Optional[str] = None
    stretch_schedule: bool = False
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    optimized_metric: Optional[str] = None  # None: the best value of monitor.metric
    data: Any = MISSING
    model: Any = MISSING
    callbacks: Any = field(default_factory=dict)
    logger: Any = field(default_factory=dict)
    tune: Optional[TuneConfig] = None


@dataclass
class EvalConfig(RunConfig):
    task_name: str = "eval"
    ckpt_path: str = MISSING
    data: Any = None  # None: the data config stored in the checkpoint
    logger: Any = field(default_factory=dict)
    callbacks: Any = field(default_factory=dict)


@dataclass
class PredictConfig(RunConfig):
    task_name: str = "predict"
    ckpt_path: str = MISSING
    input: Optional[str] = None  # images: a folder, one image, or an IDX file; None: the DataModule's predict data
    data: Dict[str, Any] = field(default_factory=dict)  # over the checkpoint's data config: data.predict_path=...
    resize: bool = True  # images of another size: resized to the model's (false: refused)
    batch_size: int = 256  # images per batch
    num_workers: int = 0  # processes decoding images
    callbacks: Any = field(default_factory=dict)


@dataclass
class ExportConfig(RunConfig):
    task_name: str = "export"
    ckpt_path: str = MISSING
    format: str = "onnx"  # onnx | torch_export
    output: Optional[str] = None  # None: beside the checkpoint, <checkpoint name>.onnx or .pt2
    overwrite: bool = False  # replace an existing `output` file (otherwise refused)
    check: bool = True  # compare the exported model's outputs with PyTorch's before finishing
    trainer: Any = None  # not used: export runs no Trainer; here so that profiles (which size it) apply too


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="predict_schema", node=PredictConfig)
    cs.store(name="export_schema", node=ExportConfig)


def check_keys(cfg: DictConfig, where: str = "") -> None:
    """Reject keys a typed node does not declare: Hydra's `+key=value` adds them past the schema, yet no code reads
    them."""
    schema = OmegaConf.get_type(cfg)
    if not is_dataclass(schema):
        return
    declared = {f.name for f in fields(schema)}
    for key in map(str, cfg):
        path = f"{where}{key}"
        if key not in declared:
            raise UserError(f"{path}: not a known key here; known keys: {', '.join(sorted(declared))}")
        child = cfg._get_node(key)
        if isinstance(child, DictConfig):
            check_keys(child, f"{path}.")


def _strings(node: Any, path: str = "") -> list[tuple[str, str]]:
    """(key, value) of every string in the config, Hydra's own node left out; interpolations as they resolve."""
    found = []
    if isinstance(node, DictConfig):
        for key in node:
            if str(key) == "hydra" and not path:
                continue
            try:
                value = node[key]
            except Exception:  # an interpolation that does not resolve here: its own check says so
                continue
            found += _strings(value, f"{path}{key!s}.")
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            found += _strings(value, f"{path[:-1]}[{i}].")
    elif isinstance(node, str):
        found.append((path[:-1], node))
    return found


def check_files(cfg: DictConfig) -> None:
    """A config path naming something other than a regular file or folder (a FIFO, a device, a socket) is refused
    before anything opens it: reading one waits for a writer that may never come (a FIFO hung predict.py)."""
    for key, value in _strings(cfg):
        if not value or len(value) > 4096 or "\0" in value:
            continue
        try:
            mode = os.stat(os.path.expanduser(value)).st_mode
        except (OSError, ValueError):
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise UserError(f"{key}={value}: {kind}, not a file or a folder; pass a regular file")


def check_config(cfg: DictConfig) -> None:
    """Everything about the run config that needs no import of torch or Lightning, before any work."""
    check_keys(cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        raise UserError(f"{key}: required; {_REQUIRED_HINTS.get(key, f'set it: {key}=...')}")
    seed = cfg.get("seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        low, high = SEED_RANGE
        raise UserError(f"seed={seed}: a seed is an integer from {low} to {high} (or null: unseeded)")
    if cfg.float32_matmul_precision not in MATMUL_PRECISIONS:
        raise UserError(
            f"float32_matmul_precision={cfg.float32_matmul_precision}: one of {', '.join(MATMUL_PRECISIONS)}"
        )
    monitor = cfg.get("monitor")
    if monitor is not None and monitor.mode not in MONITOR_MODES:
        raise UserError(f"monitor.mode={monitor.mode}: max (higher is better) or min (lower is better)")
    for package in cfg.get("trusted_packages") or []:
        if not all(part.isidentifier() for part in str(package).split(".")):
            raise UserError(f"trusted_packages: {package!r} is not a package name (letters, digits, _ and dots)")
    check_files(cfg)
    if cfg.launch.rendezvous_timeout_s <= 0:
        raise UserError(f"launch.rendezvous_timeout_s={cfg.launch.rendezvous_timeout_s}: must be a positive number")
