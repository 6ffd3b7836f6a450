"""What an evaluation needs around the user's task (project.tasks.evaluate): the checkpoint read safely, its model
rebuilt from the config it stores, and the data it was trained on (or `data=...`)."""

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine import build, contract
from engine.console import show_start
from engine.errors import RunEnded, UserError
from engine.runs import checkpoints
from engine.runs.dirs import make_output_dirs
from engine.runs.full_model import load_model
from engine.runs.results import read_metrics, write_metrics
from engine.sweeps import jobs as sweeps
from engine.tasks.seeding import seed_run

log = logging.getLogger(__name__)


def _data_config(cfg: DictConfig, train_config: dict) -> DictConfig:
    """`data=...` if given; else the checkpoint's own data config, checked like its model config, and reading
    from this machine's `paths.data_dir` rather than the directory of the machine that trained it."""
    if cfg.data is not None:
        return cfg.data
    data = train_config.get("data")
    if not isinstance(data, dict):
        raise UserError(f"ckpt_path={cfg.ckpt_path}: holds no data config; pass data=<option>")
    checkpoints.check_buildable(data, "data", kind="data", trusted=cfg.trusted_packages)
    if "data_dir" in data and data["data_dir"] != cfg.paths.data_dir:
        log.info("Data from the checkpoint's config, read from paths.data_dir=%s", cfg.paths.data_dir)
        data = {**data, "data_dir": cfg.paths.data_dir}
    data_config = OmegaConf.create(data)
    build.check_options(data_config, "data")
    return data_config


class EvalRun:
    """`model`: the checkpoint's LightningModule, its weights loaded (unless sharded: then `ckpt_path` is what the
    Trainer loads); `data`: the data config to build."""

    def __init__(self, cfg: DictConfig) -> None:
        seed_run(cfg.seed, cfg.float32_matmul_precision)
        self.cfg = cfg
        path = checkpoints.check_readable(cfg.ckpt_path)
        self.model, train_config = load_model(str(path), cfg.trusted_packages)
        build.check(cfg)
        make_output_dirs(cfg)
        self.data = _data_config(cfg, train_config)
        self.output_dir = Path(cfg.paths.output_dir)
        # a sharded checkpoint is read by the fsdp strategy itself; a file's weights are already in the model
        self.ckpt_path = str(path) if checkpoints.is_sharded(path) else None

    def trainer(self, trainer_cfg: DictConfig, callbacks: list[Any], logger: list[Any], datamodule: Any) -> Any:
        """The Trainer, once the data is built: checked against the model first (data=... of another shape)."""
        contract.check_fits(self.model, datamodule, OmegaConf.to_container(self.data, resolve=True))
        trainer = build.trainer(trainer_cfg, callbacks, logger, self.cfg.launch, speedups=self.cfg.speedups)
        if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
            sweeps.run_job_in_fresh_process(None)
            raise RunEnded(read_metrics(self.output_dir))
        checkpoints.check_strategy_reads(self.cfg.ckpt_path, trainer.strategy, "evaluate")
        show_start(self.cfg, self.output_dir)
        return trainer

    def tested(self, trainer: Any) -> dict[str, float]:
        """The test metrics, also written to <run>/test_metrics.json."""
        return write_metrics(trainer, self.output_dir / "test_metrics.json")
