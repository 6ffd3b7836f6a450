"""Test a checkpoint: `python eval.py ckpt_path=<run>/checkpoints/epoch_009.ckpt [data=...]`. See README.md."""

import hydra
from omegaconf import DictConfig

from engine import cli, run


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> dict[str, float]:
    return run("project.tasks:evaluate", cfg)  # torch and Lightning load only once a run really starts


if __name__ == "__main__":
    cli(main)
