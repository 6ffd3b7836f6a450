"""Builds every component from its config node, checking each key against its `_target_` first.

One place, one order (data, model, callbacks, loggers, trainer); components receive plain
arguments, never the whole config. A bad key or value ends as a UserError naming the field.
"""

import difflib
import inspect
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig

from project.errors import UserError
from project.launch import environment

_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def check_options(node: Any, where: str) -> None:
    """Every key of a `_target_` node must be a parameter of its target: `max_epoch` fails here, by name."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check_options(item, f"{where}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    if "_target_" in node:
        target = node._target_
        try:
            obj = hydra.utils.get_object(target)
        except Exception as e:
            raise UserError(f"{where}._target_: cannot import {target!r} ({e})") from e
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):  # builtins without a signature: let instantiate judge
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            for key in node:
                if key in _HYDRA_KEYS or key in params:
                    continue
                close = difflib.get_close_matches(str(key), list(params), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"its options are: {', '.join(params)}"
                raise UserError(f"{where}.{key}: {target} has no option {key!r}; {hint}")
    for key, value in node.items_ex(resolve=False):
        check_options(value, f"{where}.{key}")


def instantiate(node: DictConfig, where: str, **kwargs: Any) -> Any:
    """hydra.utils.instantiate with the option check first and Hydra's multi-line errors folded into one."""
    check_options(node, where)
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        message = " ".join(str(cause).split())
        raise UserError(f"{where}: {type(cause).__name__}: {message}") from e


def datamodule(cfg: DictConfig) -> Any:
    """The LightningDataModule of `data`."""
    return instantiate(cfg, "data")


def model(cfg: DictConfig) -> Any:
    """The LightningModule of `model`, its net, optimizer and scheduler factories inside."""
    return instantiate(cfg, "model")


def named(cfg: DictConfig | None, group: str) -> list[Any]:
    """`callbacks` and `logger` are mappings name -> config, so each entry can be dropped: `~callbacks.rich`."""
    return [instantiate(node, f"{group}.{name}") for name, node in (cfg or {}).items() if node is not None]


def trainer(cfg: DictConfig, callbacks: list[Any], loggers: list[Any]) -> Any:
    """The Trainer, after the checks that need no Lightning: processes vs launcher; then the ones that do."""
    import project.strategies  # noqa: F401  registers "dp" and our "ddp" before the Trainer looks names up

    environment.check_process_count(cfg.get("devices", "auto"), cfg.get("num_nodes", 1), cfg.get("strategy", "auto"))
    overrides = {**_fsdp_by_name(cfg), **_one_requeuing_party(cfg)}
    # An empty list would make Lightning add its default CSV/TensorBoard logger; False means none.
    built = instantiate(cfg, "trainer", callbacks=callbacks, logger=loggers or False, **overrides)
    _check_precision(cfg, built)
    return built


def _fsdp_by_name(cfg: DictConfig) -> dict[str, Any]:
    """Lightning maps the name "fsdp" to its GPU-only FSDP1; ours is FSDP2 everywhere (project.strategies.fsdp)."""
    if cfg.get("strategy") != "fsdp":
        return {}
    from project.strategies.fsdp import FSDPStrategy

    return {"strategy": FSDPStrategy()}


def _one_requeuing_party(cfg: DictConfig) -> dict[str, Any]:
    """Under submitit, submitit requeues (its USR2 handler resubmits the job, which resumes from
    <run>/checkpoints/last.ckpt), so Lightning's own SIGUSR1 requeue is switched off."""
    if not environment.under_submitit() or cfg.get("plugins"):
        return {}
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return {"plugins": [SLURMEnvironment(auto_requeue=False)]}


def _check_precision(cfg: DictConfig, built: Any) -> None:
    """Lightning would quietly run fp16 as bf16 without CUDA: a different experiment than the one asked for."""
    if str(cfg.get("precision")) in ("16", "16-mixed") and built.strategy.root_device.type != "cuda":
        raise UserError(
            f"trainer.precision={cfg.precision} needs a CUDA GPU (loss-scaled float16); "
            f"on {built.strategy.root_device.type} use precision=bf16_mixed"
        )
