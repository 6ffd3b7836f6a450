"""Typed top level of train.yaml and eval.yaml: Hydra rejects unknown keys and wrong types at compose time.

The groups (data, model, trainer, ...) are typed by their `_target_`; project.build checks their keys
against the target's signature before anything is built.
"""

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from project.errors import UserError


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConfig:
    task_name: str = "train"
    seed: Optional[int] = None
    train: bool = True
    test: bool = True
    ckpt_path: Optional[str] = None
    optimized_metric: Optional[str] = None
    data: Any = MISSING
    model: Any = MISSING
    trainer: Any = MISSING
    callbacks: Any = field(default_factory=dict)
    logger: Any = field(default_factory=dict)
    paths: PathsConfig = field(default_factory=PathsConfig)


@dataclass
class EvalConfig:
    task_name: str = "eval"
    seed: Optional[int] = None
    ckpt_path: str = MISSING
    data: Any = None  # None: the data config stored in the checkpoint
    trainer: Any = MISSING
    logger: Any = field(default_factory=dict)
    paths: PathsConfig = field(default_factory=PathsConfig)


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)


def check_keys(cfg: DictConfig, where: str = "") -> None:
    """Reject keys a typed node does not declare.

    Hydra's `+key=value` adds them past the schema, yet no code would read them."""
    schema = OmegaConf.get_type(cfg)
    if not is_dataclass(schema):
        return
    declared = {f.name for f in fields(schema)}
    for key in cfg:
        path = f"{where}{key}"
        if key not in declared:
            raise UserError(f"{path}: not a known key here; known keys: {', '.join(sorted(declared))}")
        child = cfg._get_node(key)
        if isinstance(child, DictConfig):
            check_keys(child, f"{path}.")
