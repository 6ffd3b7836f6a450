"""The evaluation task: test a checkpoint on the data it was trained with (or on `data=...`)."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from engine import build, contract
from engine.config.schema import check_config
from engine.errors import UserError
from engine.runs import checkpoints
from engine.runs.dirs import make_output_dirs
from engine.runs.full_model import load_model
from engine.runs.results import read_metrics, write_metrics
from engine.sweeps import jobs as sweeps
from engine.tasks.numerics import set_matmul_precision
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
    return OmegaConf.create(data)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Returns the test metrics (also written to <run>/test_metrics.json)."""

    check_config(cfg)
    seed_run(cfg.seed)
    set_matmul_precision(cfg.float32_matmul_precision)
    path = checkpoints.check_readable(cfg.ckpt_path)
    model, train_config = load_model(str(path), cfg.trusted_packages)
    build.check(cfg)
    make_output_dirs(cfg)
    data_config = _data_config(cfg, train_config)
    datamodule = build.datamodule(data_config)
    contract.check_fits(model, datamodule, OmegaConf.to_container(data_config, resolve=True))  # data=... of yours
    callbacks = build.named(cfg.callbacks, "callbacks")
    trainer = build.trainer(cfg.trainer, callbacks, build.named(cfg.logger, "logger"), cfg.launch)
    if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
        sweeps.run_job_in_fresh_process(None)
        return read_metrics(Path(cfg.paths.output_dir))
    checkpoints.check_strategy_reads(cfg.ckpt_path, trainer.strategy, "evaluate")
    sharded = checkpoints.is_sharded(path)
    trainer.test(model, datamodule=datamodule, ckpt_path=str(path) if sharded else None)
    return write_metrics(trainer, Path(cfg.paths.output_dir) / "test_metrics.json")
