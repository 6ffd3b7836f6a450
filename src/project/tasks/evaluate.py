"""The evaluation task: test a checkpoint on the data it was trained with (or on `data=...`)."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from project import build
from project.config.schema import check_keys
from project.errors import UserError
from project.launch import sweeps
from project.runs import checkpoints
from project.runs.results import read_metrics, write_metrics


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Returns the test metrics (also written to <run>/test_metrics.json)."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    check_keys(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)
    path = checkpoints.check_readable(cfg.ckpt_path)
    model, train_config = checkpoints.load_model(str(path))
    data_cfg = cfg.data if cfg.data is not None else OmegaConf.create(train_config["data"])
    datamodule = build.datamodule(data_cfg)
    trainer = build.trainer(cfg.trainer, [], build.named(cfg.logger, "logger"))
    if sweeps.is_multirun() and sweeps.launches_rank_scripts(trainer):
        sweeps.run_job_in_fresh_process(None)
        return read_metrics(Path(cfg.paths.output_dir))
    sharded = checkpoints.is_sharded(path)
    if sharded and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise UserError(
            f"ckpt_path={cfg.ckpt_path} is sharded (written by strategy=fsdp): evaluate it with trainer=fsdp "
            "(any number of devices; the shards are redistributed)"
        )
    trainer.test(model, datamodule=datamodule, ckpt_path=str(path) if sharded else None)
    return write_metrics(trainer, Path(cfg.paths.output_dir) / "test_metrics.json")
