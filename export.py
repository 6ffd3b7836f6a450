"""Export a checkpoint: `python export.py ckpt_path=<run>/checkpoints/<best>.ckpt format=onnx|torch_export`.
Writes <best>.onnx or <best>.pt2 beside the checkpoint. See README.md."""

import hydra
from omegaconf import DictConfig

from engine import cli, run


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> object:
    return run("engine.tasks.export:export", cfg)  # torch and Lightning load only once a run really starts


if __name__ == "__main__":
    cli(main)
