"""SIGTERM, SIGINT (and SIGUSR1 outside SLURM's requeue) end a run honestly: at the next step boundary every
rank saves last.ckpt, the metrics so far are written, and the process exits 128 + the signal's number
(SIGTERM: 143), with one line saying where to resume from.

Lightning's own SIGTERM handler exits 0 (a scheduler reads a killed run as a success) and broadcasts from
inside the handler, which hangs DDP when a rank other than 0 is signalled. Here the handler only sets a flag;
the ranks agree on it at each step's end (one all-reduce of one number). The handlers are installed in
`on_train_start`, after Lightning's, so they replace them for the run; Lightning puts back the ones from before
the run at its end.
"""

import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from project.runs.results import write_metrics


def _environment(trainer: L.Trainer) -> Any:
    """The cluster environment Lightning's own signal handling looks at (single-device strategies have none)."""
    return trainer._accelerator_connector.cluster_environment


def _requeued_by_lightning(trainer: L.Trainer) -> bool:
    """SLURM with Lightning's requeue: SIGUSR1 keeps Lightning's handler (checkpoint, scontrol requeue)."""
    environment = _environment(trainer)
    return type(environment).__name__ == "SLURMEnvironment" and bool(getattr(environment, "auto_requeue", False))


class GracefulStop(L.Callback):
    """Turns a stop signal into a checkpoint at the next step boundary and exit code 128 + signal."""

    def __init__(self) -> None:
        self.signum = 0

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum  # nothing else inside a handler: no I/O, no collective

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signals = [signal.SIGTERM, signal.SIGINT]
        if not _requeued_by_lightning(trainer):
            signals.append(signal.SIGUSR1)
        for signum in signals:
            signal.signal(signum, self._handler)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        flag = self.signum
        if torch.distributed.is_initialized():  # a signal to any process stops all of them at this same step
            tensor = torch.tensor([flag], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            flag = int(tensor.item())
        if not flag:
            return
        path = _last_checkpoint(trainer)
        trainer.save_checkpoint(path)  # every rank: a sharded checkpoint needs all of them
        write_metrics(trainer, Path(trainer.default_root_dir) / "fit_metrics.json", status="interrupted")
        name = signal.Signals(flag).name
        if trainer.is_global_zero:
            print(
                f"stopped by {name} at epoch {trainer.current_epoch}, step {trainer.global_step}: saved {path}; "
                f"continue with ckpt_path={path}",
                file=sys.stderr,
            )
        # Ranks that Lightning's launcher started end quietly: rank 0 reports the stop, and a child's non-zero
        # exit would make the launcher kill rank 0 before it has finished saving.
        child = trainer.global_rank != 0 and type(_environment(trainer)).__name__ == "LightningEnvironment"
        raise SystemExit(0 if child else 128 + flag)


def _last_checkpoint(trainer: L.Trainer) -> str:
    """Where resume looks: the LastCheckpoint callback's last.ckpt, or <run>/checkpoints/last.ckpt."""
    from project.callbacks.checkpoint import LastCheckpoint

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, LastCheckpoint):
            return str(callback.path)
    return str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
