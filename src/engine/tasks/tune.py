"""`tune=lr|batch_size`: Lightning's learning-rate and batch-size finders, on a Trainer of their own, before the run's.
The value belongs to a config key, checked to be the one the model really reads; with `tune.apply=true` it is
written into the config and the model or data rebuilt, so the run trains as `python train.py <override>` would.
"""

import json
import logging
import math
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine import build
from engine.errors import UserError
from engine.runs.atomic_io import write_file
from engine.runs.dirs import remove_if_unused
from engine.sweeps import jobs as sweeps

log = logging.getLogger(__name__)

FIX = "free space on the disk of paths.log_dir, or point paths.log_dir elsewhere"
UNLIMITED = {"max_epochs": -1, "max_time": None}
LR_KEYS = ("model.optimizer.lr", "model.lr", "model.learning_rate")  # where the template's and users' models keep it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stopped(BaseException):
    """A stop signal during a search, raised from its handler so the search ends at once; not an Exception, so
    Lightning passes it on (restoring the model and removing its scratch checkpoint on the way out)."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def config_key(cfg: DictConfig) -> str:
    """The config key the value found belongs to: `tune.key`, else the first of the usual places that exists."""
    if cfg.tune.key:
        if OmegaConf.select(cfg, cfg.tune.key) is None:
            raise UserError(f"tune.key={cfg.tune.key}: no such key in this config; name the key of your model's value")
        return cfg.tune.key
    if cfg.tune.mode == "batch_size":
        if OmegaConf.select(cfg, "data.batch_size") is None:
            raise UserError(
                "tune=batch_size: no data.batch_size in this config; set tune.key=<your data's batch size key>"
            )
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
    if t.mode == "batch_size" and min(t.init_val, t.max_trials, t.steps_per_trial, t.max_val) < 1:
        raise UserError(
            f"tune.init_val={t.init_val}, tune.max_trials={t.max_trials}, tune.steps_per_trial={t.steps_per_trial}, "
            f"tune.max_val={t.max_val}: each at least 1"
        )
    if t.mode == "batch_size" and t.init_val > t.max_val:
        raise UserError(
            f"tune.init_val={t.init_val} > tune.max_val={t.max_val}: the finder doubles the batch size from init_val "
            "up to max_val; start below the largest size to try"
        )
    if sweeps.is_multirun():
        raise UserError("tune: Lightning's finders tune one run; run it without -m, then sweep with the value found")
    if cfg.ckpt_path:
        raise UserError("tune with ckpt_path: the finders tune a fresh model; tune first, then train and resume")
    if not cfg.train:
        raise UserError("tune with train=false: the finders train; drop train=false")
    if cfg.trainer.get("fast_dev_run"):
        raise UserError("tune with trainer.fast_dev_run: Lightning skips the finders then; drop fast_dev_run")
    config_key(cfg)


def _tuning_trainer(cfg: DictConfig, scratch: Path) -> Any:
    """A Trainer like the run's, on one device, without the run's loggers, callbacks and checkpoints."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    trainer = build.trainer(
        # the finders count their own steps: the run's epoch and time limits would cut them short
        OmegaConf.create({**_plain(cfg.trainer), "default_root_dir": str(scratch), **UNLIMITED, **_no_validation(cfg)}),
        [],
        [],
        cfg.launch,
        speedups=cfg.speedups,
    )
    if not isinstance(trainer.strategy, SingleDeviceStrategy):  # ddp, dp, fsdp, pipe: several devices or processes
        raise UserError(
            f"tune={cfg.tune.mode}: Lightning's finders run on one device, not under "
            f"{type(trainer.strategy).__name__} on {len(getattr(trainer.strategy, 'parallel_devices', None) or [0])} "
            "devices; tune with trainer=default (or trainer.devices=1), then train with the value under any strategy"
        )
    return trainer  # without the run's callbacks: `find` stops the search on a signal itself


def _no_validation(cfg: DictConfig) -> dict[str, Any]:
    """The lr finder reads only the training loss, yet Lightning's validates at every epoch end (33 times on the tiny
    profile). The batch-size finder validates on purpose: a batch must fit in validation too."""
    return {"check_val_every_n_epoch": 2**31 - 1, "num_sanity_val_steps": 0} if cfg.tune.mode == "lr" else {}


def _plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def find(cfg: DictConfig, model: Any, datamodule: Any, output_dir: Path) -> dict[str, Any]:
    """Run the finder; write tune.json (and lr_find.png); return the report. Lightning restores the model's weights
    and optimizer from its scratch checkpoint afterwards; the scratch directory goes, whatever happens."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    key = config_key(cfg)
    scratch = output_dir / ".tune"
    trainer = _tuning_trainer(cfg, scratch)
    main = threading.current_thread() is threading.main_thread()  # where handlers can be set
    handlers = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS} if main else {}
    try:
        if cfg.tune.mode == "lr":
            value, extra = _find_lr(cfg, key, trainer, model, datamodule, output_dir)
        else:
            value, extra = _find_batch_size(cfg, key, trainer, model, datamodule)
        report = {"mode": cfg.tune.mode, "key": key, "value": value, "override": f"{key}={value}", **extra}
        write_file(output_dir / "tune.json", lambda path: path.write_text(json.dumps(report, indent=2) + "\n"), FIX)
    except MisconfigurationException as e:  # e.g. a model with two optimizers: the finder tunes one
        raise UserError(f"tune={cfg.tune.mode}: {' '.join(str(e).split())}") from e
    except _Stopped as stopped:
        shutil.rmtree(scratch, ignore_errors=True)
        (output_dir / "lr_find.png").unlink(missing_ok=True)
        remove_if_unused(output_dir)  # nothing was found: the run dir goes, as a refused run's does
        name = signal.Signals(stopped.args[0]).name
        # on a line of its own: the search's progress bar is left open
        print(f"\nstopped by {name} during tune={cfg.tune.mode}: nothing was found or written", file=sys.stderr)
        raise SystemExit(128 + stopped.args[0]) from None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        shutil.rmtree(scratch, ignore_errors=True)  # Lightning's own temporary checkpoint of the model
    return report


def _find_lr(cfg: DictConfig, key: str, trainer: Any, model: Any, datamodule: Any, output_dir: Path) -> tuple:
    """Tuner.lr_find without `update_attr`: it drives the optimizer configure_optimizers returns, so any module
    works; the value found goes to the config key the module reads its rate from (checked here)."""
    import matplotlib.pyplot as plt
    from lightning.pytorch.tuner import Tuner

    t = cfg.tune
    finder = Tuner(trainer).lr_find(
        model, datamodule=datamodule, min_lr=t.min_lr, max_lr=t.max_lr, num_training=t.num_training, update_attr=False
    )
    assert finder is not None  # None only under fast_dev_run, refused in check()
    _check_key_sets_lr(key, OmegaConf.select(cfg, key), trainer.optimizers)
    suggested = finder.suggestion()
    curve = {"lr": [float(x) for x in finder.results["lr"]], "loss": [float(x) for x in finder.results["loss"]]}
    if suggested is None:
        raise UserError(
            f"tune=lr: no suggestion from {len(curve['lr'])} steps (it needs a loss that falls over enough of "
            "them); raise tune.num_training or widen tune.min_lr..tune.max_lr"
        )
    figure: Any = finder.plot(suggest=True)
    try:
        write_file(output_dir / "lr_find.png", lambda path: figure.savefig(path, format="png", dpi=100), FIX)
    finally:
        plt.close(figure)
    return float(f"{suggested:.3g}"), curve  # rounded as the printed override says it


def _check_key_sets_lr(key: str, configured: Any, optimizers: list[Any]) -> None:
    """The optimizer's starting rate (restored by the finder) must be the configured one, or the key found is not
    what the module reads: a module that hard-codes its rate has no key to apply the value to."""
    starts = [float(g.get("initial_lr", g["lr"])) for optimizer in optimizers for g in optimizer.param_groups]
    wanted = configured if isinstance(configured, (int, float)) and not isinstance(configured, bool) else math.nan
    if not any(math.isclose(rate, wanted, rel_tol=1e-6) for rate in starts):
        raise UserError(
            f"tune=lr: the optimizer starts at lr={', '.join(f'{r:g}' for r in sorted(set(starts)))}, not at "
            f"{key}={configured}: the model does not read its rate from {key}; pass the rate to its "
            "configure_optimizers from a config key and name it with tune.key=<key>"
        )


def _find_batch_size(cfg: DictConfig, key: str, trainer: Any, model: Any, datamodule: Any) -> tuple:
    """Tuner.scale_batch_size in mode power: doubles the datamodule's `batch_size` from tune.init_val while steps
    still fit in memory, at most tune.max_trials times and up to tune.max_val (on a CPU memory rarely runs out)."""
    from lightning.pytorch.tuner import Tuner

    t = cfg.tune
    configured = OmegaConf.select(cfg, key)
    held = getattr(datamodule, "batch_size", getattr(datamodule, "hparams", {}).get("batch_size"))
    if held != configured:
        raise UserError(
            f"tune=batch_size: the datamodule's batch_size is {held}, not {key}={configured}; Lightning's finder "
            "changes the datamodule's `batch_size`: keep the batch size there (self.batch_size) and name its config "
            "key with tune.key=<key>"
        )
    found = Tuner(trainer).scale_batch_size(
        model,
        datamodule=datamodule,
        mode="power",
        init_val=t.init_val,
        max_trials=t.max_trials,
        steps_per_trial=t.steps_per_trial,
        max_val=t.max_val,
    )
    assert found is not None  # None only under fast_dev_run, refused in check()
    if found >= t.max_val:
        stopped_by = f"tune.max_val={t.max_val}"
    elif found >= t.init_val * 2 ** (t.max_trials - 1):
        stopped_by = f"tune.max_trials={t.max_trials}: raise it to try larger batches"
    else:
        stopped_by = "memory, or the training set's size"
    return int(found), {"stopped_by": stopped_by}


def apply(cfg: DictConfig, report: dict[str, Any]) -> None:
    """Write the value into the config the rest of the run is built from."""
    OmegaConf.update(cfg, report["key"], report["value"])


def said(report: dict[str, Any], applied: bool) -> str:
    """The line a run ends its tuning with: the value, what stopped the search, and the override that uses it."""
    head = f"tune={report['mode']} found {report['value']}"
    if "stopped_by" in report:
        head += f" (stopped by {report['stopped_by']})"
    if applied:
        return f"{head}; training with {report['override']} (tune.apply=true)"
    return f"{head}; train with: python train.py {report['override']}"
