"""What a training run needs around the user's task (project.tasks.train), in the order the task asks for it:
`TrainRun(cfg)` checks the configs, claims the run dir, seeds and finds where to continue; `trainer(...)` builds the
Trainer once model and data exist, checked against each other and the checkpoint.
"""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine import build, contract
from engine.callbacks import averaging
from engine.callbacks.checkpoint import wait_for_writes
from engine.callbacks.monitor import Monitor, best_key
from engine.callbacks.schedule import StretchSchedule
from engine.console import show_start
from engine.errors import RunEnded
from engine.runs import checkpoints, resume
from engine.runs.dirs import continuing, make_output_dirs
from engine.runs.results import write_metrics
from engine.sweeps import jobs as sweeps
from engine.tasks import tune
from engine.tasks.seeding import seed_run

log = logging.getLogger(__name__)


class TrainRun:
    """One training run: see the module docstring. With `tune=lr|batch_size` Lightning's finder runs here first; without
    `tune.apply=true` the run ends after it, with it the value found is written into `cfg`."""

    def __init__(self, cfg: DictConfig) -> None:
        build.check(cfg)
        if cfg.tune:
            tune.check(cfg)
        checkpoints.refuse_empty(cfg.ckpt_path)
        self.cfg = cfg
        self.output_dir = Path(cfg.paths.output_dir)
        going_on = continuing(self.output_dir)  # a restart, or the launch that wrote its checkpoints (engine.runs.dirs)
        resume.check_output_dirs(self.output_dir, cfg.callbacks, going_on)
        make_output_dirs(cfg)
        seed_run(cfg.seed, cfg.float32_matmul_precision)
        self.ckpt_path: str | None = resume.resume_point(self.output_dir, going_on, cfg.ckpt_path)
        self._resumed: dict = {}
        self._stretch: list[Any] = []
        self._metrics: dict[str, float] = {}
        self._monitor: Monitor | None = None
        self._tested = ""  # the best checkpoint of this fit, tested
        if self.ckpt_path:
            # read once, tensors mmapped: for these checks and Lightning's restore (AtomicCheckpointIO.hand_over)
            self._resumed = checkpoints.load(checkpoints.check_readable(self.ckpt_path), mmap=True)
            resume.check_same_model(self.ckpt_path, self._resumed, cfg.model)
            if cfg.train:
                length = resume.schedule_length(self.ckpt_path, self._resumed, cfg.model, cfg.stretch_schedule)
                self._stretch = [StretchSchedule(length)] if length is not None else []
                log.info("Resuming from %s", self.ckpt_path)
        if cfg.tune:
            self._tune()

    def _tune(self) -> None:
        cfg = self.cfg
        datamodule, model = build.instantiate(cfg.data, "data"), build.instantiate(cfg.model, "model")
        self._check(model, datamodule)
        show_start(cfg, self.output_dir)
        report = tune.find(cfg, model, datamodule, self.output_dir)
        log.info("%s", tune.said(report, applied=bool(cfg.tune.apply)))
        if not cfg.tune.apply:
            raise RunEnded(None)
        tune.apply(cfg, report)
        seed_run(cfg.seed)  # the task builds them again, as `python train.py <override>` would

    def _check(self, model: Any, datamodule: Any) -> None:
        cfg = self.cfg
        contract.check(model, datamodule, test=cfg.test, train=cfg.train)
        contract.check_fits(model, datamodule, OmegaConf.to_container(cfg.data, resolve=True))
        if self.ckpt_path:
            checkpoints.check_weights_fit(self.ckpt_path, self._resumed, model)

    def trainer(
        self, trainer_cfg: DictConfig, callbacks: list[Any], logger: list[Any], model: Any, datamodule: Any
    ) -> Any:
        """The Trainer, after model, data and checkpoint are checked against each other. In a sweep, a job whose
        Trainer would start more processes runs as a process of its own, and the run ends."""
        cfg = self.cfg
        self._check(model, datamodule)
        callbacks = [*callbacks, *self._stretch]
        averaging.check_callbacks(callbacks)
        if self.ckpt_path and cfg.train:
            averaging.check_resume(self.ckpt_path, self._resumed, callbacks)
        # Every checkpoint carries the plain run config (engine.runs.full_model.load_model rebuilds the model from
        # it), loadable with weights_only=True; the module's own hyperparameters stay its own.
        run_config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        trainer = build.trainer(trainer_cfg, callbacks, logger, cfg.launch, run_config, cfg.speedups)
        if self.ckpt_path:
            checkpoints.check_strategy_reads(self.ckpt_path, trainer.strategy, "resume" if cfg.train else "test")
        if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
            raise RunEnded(sweeps.run_job_in_fresh_process(self._objective_name()))
        show_start(cfg, self.output_dir)
        hand_over = getattr(trainer.strategy.checkpoint_io, "hand_over", None)
        if self.ckpt_path and hand_over is not None:
            hand_over(self.ckpt_path, self._resumed)
        for each in logger:  # the run config beside the module's own hyperparameters (TensorBoard's HParams view)
            each.log_hyperparams(run_config)
        self._monitor = next((c for c in trainer.callbacks if isinstance(c, Monitor)), None)
        return trainer

    def fitted(self, trainer: Any) -> None:
        """After fit: its numbers, with the monitored metric's best, in <run>/fit_metrics.json."""
        monitor = self._monitor
        best = {best_key(monitor.metric): monitor.best} if monitor is not None and monitor.best is not None else {}
        self._metrics.update(write_metrics(trainer, self.output_dir / "fit_metrics.json", extra=best))

    def checkpoint_to_test(self, trainer: Any) -> str | None:
        """The best checkpoint of this fit; with train=false the checkpoint given; None: the weights as they are."""
        if not self.cfg.train:
            return self.ckpt_path
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        wait_for_writes(trainer)  # rank 0's writer thread may still be writing it: every rank looks once it is there
        trainer.strategy.barrier("best checkpoint written")
        best = resume.best_to_test(best, self.ckpt_path)
        if not best:
            log.warning("No checkpoint was saved; testing the weights as they are after training.")
        self._tested = best
        return best or None

    def tested(self, trainer: Any) -> None:
        """After test: its numbers in <run>/test_metrics.json."""
        self._metrics.update(write_metrics(trainer, self.output_dir / "test_metrics.json"))
        if self._tested and trainer.is_global_zero:
            log.info("Tested %s", self._tested)

    def _objective_name(self) -> str:
        return self.cfg.optimized_metric or best_key(self.cfg.monitor.metric)

    def objective(self) -> float | None:
        """What a sweeper optimizes: `optimized_metric`, else the best `monitor.metric` of the run."""
        return sweeps.objective(self._metrics, self._objective_name())
