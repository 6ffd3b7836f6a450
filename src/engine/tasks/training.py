"""The training task: build everything from the composed config, fit, then test the best checkpoint."""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine import build, contract
from engine.callbacks import averaging
from engine.callbacks.monitor import Monitor, best_key
from engine.callbacks.schedule import StretchSchedule
from engine.config.schema import check_config
from engine.launch import environment
from engine.runs import checkpoints, resume
from engine.runs.dirs import make_output_dirs
from engine.runs.results import write_metrics
from engine.sweeps import jobs as sweeps
from engine.tasks import tune
from engine.tasks.numerics import set_matmul_precision
from engine.tasks.seeding import seed_run

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> float | None:
    """Returns the best value of `cfg.monitor.metric` (or `cfg.optimized_metric`'s), for sweepers; None when it was
    not logged."""
    check_config(cfg)
    build.check(cfg)
    if cfg.tune:
        tune.check(cfg)
    checkpoints.refuse_empty(cfg.ckpt_path)
    output_dir = Path(cfg.paths.output_dir)
    resume.check_output_dirs(output_dir, cfg.callbacks, environment.restarted())
    make_output_dirs(cfg)
    seed_run(cfg.seed)
    set_matmul_precision(cfg.float32_matmul_precision)
    ckpt_path = resume.resume_point(output_dir, environment.restarted(), cfg.ckpt_path)
    run_callbacks = []
    resumed: dict = {}
    if ckpt_path:
        resumed = checkpoints.read(ckpt_path)  # read once: for these checks and for Lightning's restore
        resume.check_same_model(ckpt_path, resumed, cfg.model)
        stretched = resume.schedule_length(ckpt_path, resumed, cfg.model, cfg.stretch_schedule) if cfg.train else None
        if stretched is not None:
            run_callbacks.append(StretchSchedule(stretched))
        if cfg.train:
            log.info("Resuming from %s", ckpt_path)

    datamodule = build.datamodule(cfg.data)
    model = build.model(cfg.model)
    contract.check(model, datamodule, test=cfg.test, train=cfg.train)
    contract.check_fits(model, datamodule, OmegaConf.to_container(cfg.data, resolve=True))
    if ckpt_path:
        checkpoints.check_weights_fit(ckpt_path, resumed, model)
    if cfg.tune:
        report = tune.find(cfg, model, datamodule, output_dir)
        if not cfg.tune.apply:
            log.info("%s", tune.said(report, applied=False))
            return None
        log.info("%s", tune.said(report, applied=True))
        tune.apply(cfg, report)
        seed_run(cfg.seed)  # built again as `python train.py <override>` would build them
        datamodule, model = build.datamodule(cfg.data), build.model(cfg.model)
    # Every checkpoint carries the plain run config (engine.runs.full_model.load_model rebuilds the model from it),
    # loadable with weights_only=True; the module's own hyperparameters stay its own.
    run_config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    monitor = Monitor(cfg.monitor.metric, cfg.monitor.mode)
    callbacks = [monitor, *build.named(cfg.callbacks, "callbacks"), *run_callbacks]
    if ckpt_path and cfg.train:
        averaging.check_resume(ckpt_path, resumed, callbacks)
    loggers = build.named(cfg.logger, "logger")
    trainer = build.trainer(cfg.trainer, callbacks, loggers, cfg.launch, cfg.checks.every_n_steps, run_config)
    if ckpt_path:
        checkpoints.check_strategy_reads(ckpt_path, trainer.strategy, "resume" if cfg.train else "test")
    objective = cfg.optimized_metric or best_key(cfg.monitor.metric)
    if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
        return sweeps.run_job_in_fresh_process(objective)
    hand_over = getattr(trainer.strategy.checkpoint_io, "hand_over", None)
    if ckpt_path and hand_over is not None:
        hand_over(ckpt_path, resumed)
    for logger in loggers:  # the run config beside the module's own hyperparameters (TensorBoard's HParams view)
        logger.log_hyperparams(run_config)

    metrics: dict[str, float] = {}
    if cfg.train:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)  # a divergence is recorded where it is found
        found = {best_key(monitor.metric): monitor.best} if monitor.best is not None else {}
        metrics.update(write_metrics(trainer, output_dir / "fit_metrics.json", extra=found))
    if cfg.test:
        best = trainer.checkpoint_callback.best_model_path if cfg.train and trainer.checkpoint_callback else ""
        best = resume.best_to_test(best, ckpt_path)
        if cfg.train and not best:
            log.warning("No checkpoint was saved; testing the weights as they are after training.")
        trainer.test(model, datamodule=datamodule, ckpt_path=best or (None if cfg.train else ckpt_path))
        metrics.update(write_metrics(trainer, output_dir / "test_metrics.json"))
        if best and trainer.is_global_zero:
            log.info("Tested %s", best)
    return sweeps.objective(metrics, objective)
