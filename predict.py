"""Predict with a checkpoint: `python predict.py ckpt_path=<run>/checkpoints/<best>.ckpt input=<folder|image|IDX>`.
Writes <run>/predictions.csv. See README.md."""

import hydra
from omegaconf import DictConfig

from engine import cli, run


@hydra.main(version_base="1.3", config_path="conf", config_name="predict")
def main(cfg: DictConfig) -> object:
    return run("project.tasks:predict", cfg)  # torch and Lightning load only once a run really starts


if __name__ == "__main__":
    cli(main)
