"""A loss that is no longer finite stops the run within the step, before the optimizer applies it.

Checked on the gradients in `on_before_optimizer_step`, so the weights are never updated with NaN, and on the
weights after each step (a finite gradient times a huge learning rate overflows them), before any checkpoint
callback of that step runs: the last checkpoint saved stays the last good one. All ranks agree (one
all-reduce of one flag). With fp16 mixed precision, infinite gradients are how the loss scaler finds its scale
(it skips those steps), so there the loss is checked instead of the gradients.
"""

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from project.errors import UserError


class DivergedError(UserError):
    """The run diverged; the message says where and what to change."""


class StopOnDivergence(L.Callback):
    def __init__(self) -> None:
        self.last_finite: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        finite_loss = True
        if isinstance(loss, torch.Tensor):
            value = float(loss.detach())
            finite_loss = math.isfinite(value)
            if finite_loss:
                self.last_finite = value
        bad = not _finite([p.detach() for p in pl_module.parameters()]) or (_loss_scaled(trainer) and not finite_loss)
        if _any_rank(trainer, bad):
            self._stop(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if _loss_scaled(trainer):
            return
        if _any_rank(trainer, not _finite([p.grad for p in pl_module.parameters() if p.grad is not None])):
            self._stop(trainer)

    def _stop(self, trainer: L.Trainer) -> None:
        last = "none yet" if self.last_finite is None else f"{self.last_finite:.4g}"
        checkpoints = sorted(Path(trainer.default_root_dir).glob("checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
        kept = f"the last good checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was saved yet"
        raise DivergedError(
            f"diverged at epoch {trainer.current_epoch}, step {trainer.global_step}: the loss is not finite "
            f"(last finite loss: {last}); lower the learning rate (model.optimizer.lr) or clip gradients "
            f"(trainer.gradient_clip_val=1.0); {kept}"
        )


def _finite(tensors: list[Any]) -> bool:
    """All finite, in one pass: a norm is inf or nan when any element is."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP's DTensors: this rank's shard
    if not local:
        return True
    return bool(torch.stack([n.float() for n in torch._foreach_norm(local)]).isfinite().all())


def _any_rank(trainer: L.Trainer, flag: bool) -> bool:
    """True on every process when it is true on any: over all of them (a pipeline's stages too), not only over
    the strategy's data-parallel group."""
    if not torch.distributed.is_initialized():
        return flag
    tensor = torch.tensor([float(flag)], device=trainer.strategy.root_device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return bool(tensor.item())


def _loss_scaled(trainer: L.Trainer) -> bool:
    return getattr(trainer.precision_plugin, "scaler", None) is not None
