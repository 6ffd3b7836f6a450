"""The training task: build everything from the composed config, fit, then test the best checkpoint."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from project import build
from project.callbacks.divergence import DivergedError
from project.callbacks.schedule import StretchSchedule
from project.config.schema import check_config
from project.launch import environment, sweeps
from project.runs import checkpoints, resume
from project.runs.dirs import make_output_dirs
from project.runs.results import write_metrics
from project.tasks.numerics import set_matmul_precision
from project.tasks.seeding import seed_run

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> float | None:
    """Returns the value of `cfg.optimized_metric` (for sweepers), or None when it was not logged."""
    check_config(cfg)
    build.check(cfg)
    output_dir = Path(cfg.paths.output_dir)
    resume.check_output_dir(output_dir, environment.restarted())
    make_output_dirs(cfg)
    seed_run(cfg.seed)
    set_matmul_precision(cfg.float32_matmul_precision)
    ckpt_path = resume.resume_point(output_dir, environment.restarted(), cfg.ckpt_path)
    run_callbacks = []
    if ckpt_path:
        resume.check_same_model(ckpt_path, cfg.model)
        stretched = resume.schedule_length(ckpt_path, cfg.model, cfg.stretch_schedule) if cfg.train else None
        if stretched is not None:
            run_callbacks.append(StretchSchedule(stretched))
        if cfg.train:
            log.info("Resuming from %s", ckpt_path)

    datamodule = build.datamodule(cfg.data)
    model = build.model(cfg.model)
    if ckpt_path:
        checkpoints.check_weights_fit(ckpt_path, model)
    # The plain run config is the module's hyperparameters: every checkpoint carries what rebuilds the model
    # (project.runs.checkpoints.load_model), loadable with weights_only=True.
    model.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
    callbacks, loggers = build.named(cfg.callbacks, "callbacks") + run_callbacks, build.named(cfg.logger, "logger")
    trainer = build.trainer(cfg.trainer, callbacks, loggers, cfg.launch)
    if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
        return sweeps.run_job_in_fresh_process(cfg.optimized_metric)

    metrics: dict[str, float] = {}
    if cfg.train:
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        except DivergedError:
            write_metrics(trainer, output_dir / "fit_metrics.json", status="diverged")
            raise
        metrics.update(write_metrics(trainer, output_dir / "fit_metrics.json"))
    if cfg.test:
        best = trainer.checkpoint_callback.best_model_path if cfg.train and trainer.checkpoint_callback else ""
        if cfg.train and not best:
            log.warning("No checkpoint was saved; testing the weights as they are after training.")
        trainer.test(model, datamodule=datamodule, ckpt_path=best or (None if cfg.train else ckpt_path))
        metrics.update(write_metrics(trainer, output_dir / "test_metrics.json"))
        if best and trainer.is_global_zero:
            log.info("Tested %s", best)
    return sweeps.objective(metrics, cfg.optimized_metric)
