"""The evaluation task: test a checkpoint on the data it was trained with (or on `data=...`)."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from project import build, checkpoints
from project.config.schema import check_keys
from project.train import write_metrics


def evaluate(cfg: DictConfig) -> dict[str, float]:
    import lightning.pytorch as L

    check_keys(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)
    model, train_config = checkpoints.load_model(cfg.ckpt_path)
    data_cfg = cfg.data if cfg.data is not None else OmegaConf.create(train_config["data"])
    datamodule = build.datamodule(data_cfg)
    trainer = build.trainer(cfg.trainer, [], build.loggers(cfg.logger))
    trainer.test(model, datamodule=datamodule)
    return write_metrics(trainer, Path(cfg.paths.output_dir) / "test_metrics.json")
