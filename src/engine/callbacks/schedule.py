"""`stretch_schedule=true`: a resumed run with more epochs continues on the cosine curve of the new length.
A checkpoint restores its scheduler whole, length included, so extra epochs would climb back up the cosine; here the
stored schedule gets the new length and the learning rate that curve's value at the current epoch.
"""

import math
from typing import Any

import lightning.pytorch as L


class StretchSchedule(L.Callback):
    def __init__(self, t_max: int) -> None:
        self.t_max = t_max

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        optimizers = checkpoint.get("optimizer_states") or []
        for index, state in enumerate(checkpoint.get("lr_schedulers") or []):
            if not isinstance(state, dict) or "T_max" not in state:
                continue
            epoch, low = state["last_epoch"], state.get("eta_min", 0.0)
            lrs = [low + (base - low) * (1 + math.cos(math.pi * epoch / self.t_max)) / 2 for base in state["base_lrs"]]
            state["T_max"], state["_last_lr"] = self.t_max, lrs
            if index < len(optimizers):
                for group, lr in zip(optimizers[index]["param_groups"], lrs):
                    group["lr"] = lr
