"""The run's resolved config in every checkpoint, under its own key: what rebuilds the model and its data later
(eval.py, predict.py, export.py), whatever the LightningModule keeps as its own hyperparameters."""

from typing import Any

import lightning.pytorch as L

from project.runs.checkpoints import CONFIG_KEY


class RunConfigInCheckpoints(L.Callback):
    """`config`: plain containers only (OmegaConf.to_container(cfg, resolve=True)), so every checkpoint loads with
    torch.load(weights_only=True)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
