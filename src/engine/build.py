"""Builds every component from its config node, checking each key and value against its `_target_` first: one place,
one order (data, model, callbacks, loggers, trainer); components get plain arguments, never the whole config.
"""

import difflib
import inspect
import logging
import os
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf

from engine.errors import UserError
from engine.launch import devices, processes

log = logging.getLogger(__name__)

_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def _describe(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    if annotation in names:
        return names[annotation]
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, Sequence):
        return "a list"
    return getattr(annotation, "__name__", str(annotation))


def _fits(value: Any, annotation: Any) -> bool | None:
    """Does a config value fit a parameter's annotation? None when the annotation says nothing we can check
    from config values (classes, callables): those are left to the target itself."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, a) for a in args]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in args and type(value) in {type(a) for a in args}
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False if isinstance(value, (int, float, str, bool)) or value is None else None
        inner = [a for a in args if a is not Ellipsis]
        if len(inner) == 1:
            verdicts = [_fits(v, inner[0]) for v in value]
            return False if False in verdicts else (None if None in verdicts else True)
        return None
    return None  # a class or callable: the target itself judges


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj, eval_str=True)
    except Exception:  # builtins without a signature, unresolvable annotations: let instantiate judge
        try:
            return inspect.signature(obj)
        except (TypeError, ValueError):
            return None


def _targets(node: Any, where: str) -> Iterator[tuple[DictConfig, str]]:
    """Every `_target_` node in a config, outer ones first, with where it is (`trainer.plugins[0]`)."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _targets(item, f"{where}[{i}]")
    elif isinstance(node, DictConfig):
        if "_target_" in node:
            yield node, where
        for key, value in node.items_ex(resolve=False):
            yield from _targets(value, f"{where}.{key!s}")


def _imported(target: str, where: str) -> Any:
    """`a.b.C`, imported without Hydra's multi-line ERROR log; a failure is one line saying where the target's
    package was found (another checkout's, by an editable install?) and, for a misspelled name, the close one."""
    import importlib

    parts, obj = target.split("."), None
    try:
        obj = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], start=1):
            if not hasattr(obj, part) and not hasattr(obj, "__path__"):  # a module or class, not a package
                raise AttributeError(f"{'.'.join(parts[:i])} has no {part!r}")
            obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[: i + 1]))
        return obj
    except Exception as e:
        said = f"{where}._target_: cannot import {target!r}: {type(e).__name__}: {' '.join(str(e).split())}"
        missing = isinstance(e, (ModuleNotFoundError, AttributeError))
        close = difflib.get_close_matches(parts[-1], dir(obj), n=1) if missing and obj is not None else []
        said += f"; did you mean {close[0]!r}?" if close else ""
        origin = getattr(sys.modules.get(parts[0]), "__file__", None)
        said += f" ({parts[0]} is imported from {Path(origin).parent})" if missing and origin else ""
        raise UserError(said) from e


def check_options(config: Any, at: str) -> None:
    """Every key of a `_target_` node must be a parameter of its target, and every plain value must fit its
    annotation: `max_epoch=3` and `max_epochs=many` fail here, by name, before anything is built."""
    for node, where in _targets(config, at):
        target = node._target_
        obj = _imported(target, where)
        signature = _signature(obj)
        params = signature.parameters if signature is not None else None
        keys = [str(key) for key in node]
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            for key in keys:
                if key in _HYDRA_KEYS or key in params:
                    continue
                close = difflib.get_close_matches(str(key), list(params), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"its options are: {', '.join(params)}"
                raise UserError(f"{where}.{key}: {target} has no option {key!r}; {hint}")
        for key in keys if params is not None else []:
            child = node._get_node(key)
            if key in _HYDRA_KEYS or params is None or key not in params or isinstance(child, DictConfig):
                continue
            assert child is not None
            value = OmegaConf.to_container(child, resolve=True) if isinstance(child, ListConfig) else node[key]
            if _fits(value, params[key].annotation) is False:
                source = f" (from {child._value()})" if OmegaConf.is_interpolation(node, key) else ""
                expected = _describe(params[key].annotation)
                raise UserError(f"{where}.{key}={value!r}{source}: {target} expects {expected} for {key!r}")


def _check_factories(config: Any, at: str) -> None:
    """Optimizers and schedulers are partials that Lightning completes only inside fit; build each once
    on a stand-in parameter now, so `lr=-1` fails at start with the optimizer's own words."""
    for node, where in _targets(config, at):
        if not node.get("_partial_", False):
            continue
        import torch

        cls = hydra.utils.get_object(node._target_)
        if inspect.isclass(cls):
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            trial = None
            if issubclass(cls, torch.optim.Optimizer):
                trial = lambda factory: factory([torch.nn.Parameter(torch.zeros(1))])  # noqa: E731
            elif issubclass(cls, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
                trial = lambda factory: factory(optimizer)  # noqa: E731
            if trial is not None:
                try:
                    built = trial(hydra.utils.instantiate(node))
                except Exception as e:
                    raise UserError(f"{where}: {type(e).__name__}: {' '.join(str(e).split())}") from e
                _first_step(built, optimizer, node, where)


def _shown(node: DictConfig, key: str) -> str:
    """`key=value`, and where an interpolated value comes from: `T_max=0 (from trainer.max_epochs)`."""
    value = node[key]
    if OmegaConf.is_interpolation(node, key):
        raw: Any = node._get_node(key)
        source = str(raw._value())  # the text `${trainer.max_epochs}`
        return f"{key}={value} (from {source.removeprefix('${').removesuffix('}')})"
    return f"{key}={value}"


def _first_step(scheduler: Any, optimizer: Any, node: DictConfig, where: str) -> None:
    """Step a just-built scheduler once: `T_max=0` divides by zero only there, in torch's words, which name no
    setting; the error names the config's values."""
    import torch

    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # its step needs a metric
    if plateau or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):  # or it is an optimizer
        return
    optimizer.step()  # no gradients: changes nothing, but comes first as torch expects
    try:
        scheduler.step()
    except Exception as e:
        values = ", ".join(_shown(node, str(k)) for k in node.keys() if not str(k).startswith("_"))  # built: resolves
        failure = f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise UserError(f"{where}: its first step fails with {values} ({failure}); change them") from e


def instantiate(node: DictConfig, where: str, **kwargs: Any) -> Any:
    """hydra.utils.instantiate of a node `check` has passed, with Hydra's multi-line errors folded into one."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        raise one_line(e, where) from e


def one_line(error: InstantiationException, where: str | None = None) -> UserError:
    """What a target refused while Hydra built it (`data: ValueError: val_size + test_size must ...`), in one line;
    where it was in the config, from Hydra's own message when not given."""
    cause = error.__cause__ if error.__cause__ is not None else error
    if isinstance(cause, UserError):  # already one line that names the fix (a strategy's own checks)
        return cause
    if where is None:
        found = [line.split("full_key:", 1)[1].strip() for line in str(error).splitlines() if "full_key:" in line]
        where = found[-1] if found else "config"
    message = " ".join(str(cause).split("full_key:")[0].split())
    return UserError(f"{where}: {type(cause).__name__}: {message}")


def check(cfg: DictConfig) -> None:
    """Every component config of a run, before any is built; the trainer's first, since others refer to it
    (`T_max: ${trainer.max_epochs}`), so a bad value is reported where it was typed."""
    for group in ("trainer", "data", "model", "callbacks", "logger"):
        if cfg.get(group) is not None:
            check_options(cfg[group], group)
            _check_factories(cfg[group], group)


def named(cfg: DictConfig | None, group: str) -> list[Any]:
    """`callbacks` and `logger` are mappings name -> config, so each entry can be dropped: `~callbacks.rich`."""
    return [instantiate(node, f"{group}.{name!s}") for name, node in (cfg or {}).items() if node is not None]


# Trainer settings Lightning takes without a check and fails on much later (a division by zero in epoch 1).
_AT_LEAST = {
    "check_val_every_n_epoch": 1,
    "log_every_n_steps": 1,
    "accumulate_grad_batches": 1,
    "num_nodes": 1,
    "max_epochs": -1,
    "min_epochs": 0,
    "max_steps": -1,
    "reload_dataloaders_every_n_epochs": 0,
}


def _check_accelerator(cfg: DictConfig) -> None:
    """A GPU asked for where torch sees none: say what is visible and what to use (Lightning's own words are "No
    supported gpu backend found!")."""
    asked = cfg.get("accelerator")
    if asked not in ("gpu", "cuda"):
        return
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    if CUDAAccelerator.is_available() or (asked == "gpu" and MPSAccelerator.is_available()):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    raise UserError(
        f"trainer.accelerator={asked}: torch sees no GPU here{hidden}; use trainer=cpu, or trainer.accelerator=auto "
        "(whatever this machine has); `make devices` lists what it has"
    )


def _check_trainer_numbers(cfg: DictConfig) -> None:
    for key, least in _AT_LEAST.items():
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise UserError(f"trainer.{key}={value}: must be at least {least}")


def trainer(
    cfg: DictConfig,
    callbacks: list[Any],
    loggers: list[Any],
    launch: Any = None,
    run_config: dict[str, Any] | None = None,
    speedups: bool = True,
) -> Any:
    """The Trainer, checked before and after Lightning builds it; `run_config` goes into checkpoints via RunState.
    `speedups`: shortcuts through Lightning's per-step bookkeeping, each >5% of a CPU step (benchmarks/speedups.py)."""
    import engine.strategies  # noqa: F401  registers "dp" and our "ddp" before the Trainer looks names up
    from engine.callbacks.dispatch import skip_unused_hooks
    from engine.loggers.logged_values import skip_needless_moves

    _check_trainer_numbers(cfg)
    _check_accelerator(cfg)

    processes.check_process_count(cfg.get("devices", "auto"), cfg.get("num_nodes", 1), cfg.get("strategy", "auto"))
    callbacks = _callbacks_for(callbacks, loggers)
    _hand_run_config(callbacks, run_config)
    overrides = {**_fsdp_by_name(cfg), **_plugins(cfg), **_checkpointing(cfg, callbacks)}
    if speedups:
        overrides.update(_profiler(cfg))
    from engine.console import ignore_known_warnings

    ignore_known_warnings()  # Lightning's srun hint among them: also where a Trainer is built in-process (tests)
    # An empty list would make Lightning add its default CSV/TensorBoard logger; False means none.
    built = instantiate(cfg, "trainer", callbacks=callbacks, logger=loggers or False, **overrides)
    _check_precision(cfg, built)
    _check_processes(built, launch)
    if speedups:
        skip_unused_hooks(built.callbacks)  # with the ones Lightning added (its progress bar, model summary)
        skip_needless_moves()  # self.log no longer moves its result object to where it already is
        devices.answer_cuda_checks_without_nvml()  # no GPU: no NVML lookup in every optimizer step
    return built


def _profiler(cfg: DictConfig) -> dict[str, Any]:
    """No profiler asked for: one that costs nothing per hook call (engine.callbacks.dispatch)."""
    if cfg.get("profiler") is not None:
        return {}
    from engine.callbacks.dispatch import QuietProfiler

    return {"profiler": QuietProfiler()}


def _callbacks_for(callbacks: list[Any], loggers: list[Any]) -> list[Any]:
    """A learning-rate monitor writes to the loggers; with `logger=none` it has nowhere to write (and Lightning
    would stop the run for it), so it is left out, and the log says so."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    if loggers:
        return callbacks
    dropped = [c for c in callbacks if isinstance(c, LearningRateMonitor)]
    if dropped:
        log.info("No logger: the learning-rate monitor is left out (it writes only to loggers).")
    return [c for c in callbacks if not isinstance(c, LearningRateMonitor)]


def _checkpointing(cfg: DictConfig, callbacks: list[Any]) -> dict[str, Any]:
    """Checkpoints are what the callbacks config says: Lightning would add a ModelCheckpoint of its own
    to `callbacks=none`."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if "enable_checkpointing" in cfg:
        return {}
    return {"enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks)}


def _fsdp_by_name(cfg: DictConfig) -> dict[str, Any]:
    """Lightning maps the name "fsdp" to its GPU-only FSDP1; ours is FSDP2 everywhere (engine.strategies.fsdp)."""
    if cfg.get("strategy") != "fsdp":
        return {}
    from engine.strategies.fsdp import FSDPStrategy

    return {"strategy": FSDPStrategy()}


def _hand_run_config(callbacks: list[Any], run_config: dict[str, Any] | None) -> None:
    """Checkpoints carry the plain run config, from which eval, predict, export and a resume rebuild the model."""
    from engine.callbacks.run_state import RunState

    for callback in callbacks:
        if isinstance(callback, RunState) and run_config is not None:
            callback.config = run_config


def _plugins(cfg: DictConfig) -> dict[str, Any]:
    """Under submitit, submitit requeues (its USR2 handler resubmits the job, which resumes from
    <run>/checkpoints/last.ckpt), so Lightning's own SIGUSR1 requeue is switched off beside the config's plugins."""
    from engine.launch import environment

    if not environment.under_submitit():
        return {}
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    plugins = [hydra.utils.instantiate(node) for node in cfg.get("plugins") or []]
    return {"plugins": [*plugins, SLURMEnvironment(auto_requeue=False)]}


def _check_precision(cfg: DictConfig, built: Any) -> None:
    """Lightning would quietly run fp16 as bf16 without CUDA: a different experiment than the one asked for."""
    if str(cfg.get("precision")) in ("16", "16-mixed") and built.strategy.root_device.type != "cuda":
        raise UserError(
            f"trainer.precision={cfg.precision} needs a CUDA GPU (loss-scaled float16); "
            f"on {built.strategy.root_device.type} use precision=bf16_mixed"
        )


def _check_processes(built: Any, launch: Any) -> None:
    """What the resolved trainer will start: CPU processes vs cores, and where several nodes meet."""
    from lightning.pytorch.accelerators import CPUAccelerator

    allow = bool(launch.allow_oversubscribe) if launch is not None else False
    launcher = getattr(built.strategy, "launcher", None)
    if isinstance(built.accelerator, CPUAccelerator) and launcher is not None:
        processes.check_cpu_processes(built.num_devices, allow)
    if built.num_nodes > 1:
        processes.check_node_meeting(built.num_nodes, type(built.strategy.cluster_environment).__name__)
    meeting_port = getattr(launcher, "meeting_port", None)  # ddp and fsdp ranks this process starts: where they meet
    if meeting_port is not None:
        meeting_port()
    if launch is not None and hasattr(built.strategy, "rendezvous_timeout_s"):
        built.strategy.rendezvous_timeout_s = int(launch.rendezvous_timeout_s)
