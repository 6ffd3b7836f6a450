"""Train a model: `python train.py [group=option ...] [key=value ...]`. See README.md."""

import hydra
from omegaconf import DictConfig

from engine import cli, run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run("project.tasks:train", cfg)  # torch and Lightning load only once a run really starts


if __name__ == "__main__":
    cli(main)
