"""What stops a run: a non-finite loss or weight, or a signal (SIGTERM, SIGINT; SIGUSR1 outside SLURM's requeue),
agreed in one collective every `every_n_steps` steps, with no host sync per step. Lightning's SIGTERM handler exits 0
and broadcasts inside the handler (DDP hangs when rank != 0 is signalled); ours only records the signal.
"""

import math
import signal
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as L
import torch

from engine.errors import UserError, say
from engine.runs.continuing import continue_command
from engine.runs.results import write_metrics


class DivergedError(UserError):
    """The run diverged; the message says where and what to change."""


def _environment(trainer: L.Trainer) -> Any:
    """The cluster environment Lightning's own signal handling looks at (single-device strategies have none)."""
    return trainer._accelerator_connector.cluster_environment


def _requeued_by_lightning(trainer: L.Trainer) -> bool:
    """SLURM with Lightning's requeue: SIGUSR1 keeps Lightning's handler (checkpoint, scontrol requeue)."""
    environment = _environment(trainer)
    return type(environment).__name__ == "SLURMEnvironment" and bool(getattr(environment, "auto_requeue", False))


def _norm_sum(tensors: list[Any], device: torch.device) -> torch.Tensor:
    """One float32 number on `device`, inf or nan when any element of any tensor is not finite: the sum of their
    norms (0 for none). Three tensor ops whatever their number (no detach: no graph is recorded here)."""
    with torch.no_grad():  # a DTensor's to_local() too: with grad enabled it is an autograd function
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP's DTensors: this rank's shard
        local = [t for t in local if t.numel()]
        if not local:
            return torch.zeros((), device=device)
        norms = list(torch._foreach_norm(local, 2, dtype=torch.float32))  # fp16's own would overflow sound weights
        if any(n.device != device for n in norms):  # pipe's stages sit on several devices
            norms = [n.to(device) for n in norms]
        return torch.stack(norms).sum()


def _versions(module: L.LightningModule) -> int:
    """Changes with every in-place change to a weight (an optimizer step, a hook that rescales them)."""
    return sum(p._version for p in module.parameters())


class RunChecks(L.Callback):
    """See the module docstring. `every_n_steps`: optimizer steps between the ranks' agreements (config:
    `checks.every_n_steps`)."""

    def __init__(self, every_n_steps: int = 20) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: must be >= 1")
        self.every_n_steps = every_n_steps
        self.signum = 0
        # On the device, never read per step: the sum of the losses since the run started, and the last one.
        self._losses: torch.Tensor | None = None
        self._last: torch.Tensor | None = None
        self._last_finite: float | None = None  # the loss at the last agreement
        self._agreed_at = 0  # the global step of the last agreement: the run was sound up to there
        self._agreed_losses: torch.Tensor | None | bool = False  # the loss sum then (False: no agreement yet)
        self._agreed_versions = -1  # and the weights' in-place versions
        self._stopping = False
        self._in_step = False  # agreeing inside a training step's end hooks
        self._signalled: tuple[int, int] | None = None  # a signal found at an epoch's end, and that epoch
        self._trained = False
        self._test_batches = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # a sum of the losses is not finite once any of them was not: one addition a step, on the device (a
            # cast and a sum only for a loss that is not one float32 number: an fp16 sum would overflow)
            loss = loss.detach()
            if loss.dtype != torch.float32 or loss.ndim:
                loss = loss.float().sum()
            self._losses = loss if self._losses is None else self._losses + loss
            self._last = loss
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._agreed_at:
            # On an epoch's last batch a signal waits for the epoch's end (its validation and checkpoints, a few
            # moments): a last.ckpt saved before them would resume past that epoch's validation.
            last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            self._in_step = True  # a stop here cuts this step's end hooks short (_log_the_step_cut_short)
            try:
                self._agree(trainer, pl_module, signals=not last)
            finally:
                self._in_step = False

    def _agree(
        self, trainer: L.Trainer, pl_module: L.LightningModule, signals: bool, at_epoch_end: bool = False
    ) -> None:
        """One collective of four numbers (loss sum, weights check, signal, last loss) and one host sync, then act.
        `signals=False` (inside a save): divergence only; `at_epoch_end`: a signal stops fit after the epoch's saves."""
        if self._stopping:
            return
        device = trainer.strategy.root_device
        weights = _norm_sum(list(pl_module.parameters()), device)
        losses = self._losses.to(device) if self._losses is not None else weights.new_zeros(())
        last = self._last.to(device) if self._last is not None else weights.new_zeros(())
        signum = float(self.signum if signals else 0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # 1 where not finite (a max over the ranks of a NaN is not reliable). Built on the device: a Python number
            # written into a GPU tensor is a blocking copy, a second host sync (seen on an H200 over NCCL).
            bad = torch.stack([losses, weights]).isfinite().logical_not().to(weights.dtype)
            found = torch.cat([bad, weights.new_full((1,), signum), last.reshape(1).to(weights.dtype)])
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            bad_loss, bad_weights, signum_found, last_loss = found.tolist()  # the one host sync
        else:  # one process: the numbers read back as they are (the one host sync) and checked here
            loss_sum, weight_sum, last_loss = torch.stack([losses, weights, last]).tolist()
            bad_loss, bad_weights, signum_found = not math.isfinite(loss_sum), not math.isfinite(weight_sum), signum
        if bad_loss or bad_weights:
            self._stopping = True
            if math.isfinite(last_loss):  # the step's own loss, when only what it did to the weights is not finite
                self._last_finite = last_loss
            self._end_diverged(trainer, "loss" if bad_loss else "weights")
        self._agreed_at = trainer.global_step
        if self._last is not None:  # before any step (the agreement at the start of training) no loss is known
            self._last_finite = last_loss  # the largest over the ranks
        self._agreed_losses, self._agreed_versions = self._losses, _versions(pl_module)
        if signum_found and at_epoch_end:
            # last.ckpt now: the epoch's own saves may not come (no validation) or come after weight averaging swaps
            # the average in. The epoch's checkpoints follow, then fit ends (unless min_epochs are not done).
            self._save_last(trainer)
            self._signalled, trainer.should_stop = (int(signum_found), trainer.current_epoch), True
        elif signum_found:
            self._stopping = True
            self._stop(trainer, int(signum_found))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agree(trainer, pl_module, signals=True, at_epoch_end=True)  # before the epoch's checkpoints

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if fitting and not self._agreed_on_this(trainer, pl_module):
            self._agree(trainer, pl_module, signals=False)  # a checkpoint is never written after the run diverged

    def _agreed_on_this(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """The ranks already agreed on these weights and losses (the epoch's end agreed just before its last.ckpt is
        saved): no step, no loss and no change to any weight since (tensor versions count in-place changes)."""
        return (
            self._agreed_losses is self._losses
            and self._agreed_at == trainer.global_step
            and self._agreed_versions == _versions(pl_module)
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._signalled is not None:  # at an epoch's end, whose checkpoints are saved now
            (signum, epoch), self._stopping = self._signalled, True
            self._stop(trainer, signum, epoch, saved=True)
        self._agree(trainer, pl_module, signals=True)

    def _end_diverged(self, trainer: L.Trainer, what: str) -> NoReturn:
        """Rank 0 records it (fit_metrics.json) and raises it, said once; other ranks log it and end quietly (a
        child's exit 2 could reach rank 0's watcher as a death before rank 0 had said it)."""
        error = self._diverged(trainer, what)
        write_metrics(trainer, Path(trainer.default_root_dir) / "fit_metrics.json", status="diverged")
        if trainer.is_global_zero:
            raise error
        say(f"error: {error}", console=False)
        raise SystemExit(self._exit_code(trainer, 2))

    def _diverged(self, trainer: L.Trainer, what: str) -> DivergedError:
        # known at a passed agreement, or as the step's own loss when only its weights went bad; not before
        last = "" if self._last_finite is None else f" (last finite loss: {self._last_finite:.4g})"
        checkpoints = sorted(_checkpoint_files(trainer), key=lambda p: p.stat().st_mtime)
        kept = f"the last good checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was saved yet"
        return DivergedError(
            f"diverged in epoch {trainer.current_epoch}, between steps {self._agreed_at} and {trainer.global_step}: "
            f"the {what} stopped being finite{last}; lower the learning rate "
            f"({_lr_key(trainer)}) or clip gradients (trainer.gradient_clip_val=1.0); {kept}"
        )

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum  # nothing else inside a handler: no I/O, no collective

    def _install(self, trainer: L.Trainer) -> None:
        signals = [signal.SIGTERM, signal.SIGINT]
        if not _requeued_by_lightning(trainer):
            signals.append(signal.SIGUSR1)
        for signum in signals:
            signal.signal(signum, self._handler)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before Lightning registers its own handlers for the stage: these are what it puts back after each stage,
        # so a signal between fit and test is recorded too.
        self._install(trainer)
        # Lightning's SIGTERM handler broadcasts from inside the handler, on the signalled rank alone (a hang, or
        # gloo's abort): ours replace it as soon as it is registered, not at the next hook.
        connector = trainer._signal_connector
        if "register_signal_handlers" not in connector.__dict__:
            lightnings = connector.register_signal_handlers

            def register_then_ours() -> None:
                lightnings()
                self._install(trainer)

            connector.__dict__["register_signal_handlers"] = register_then_ours

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)
        self._trained = True  # a test after it follows a fit (train.py), not only a checkpoint (eval.py)
        # Lightning's epoch loop broadcasts rank 0's SIGTERM flag every step (a collective and a host sync per
        # step); SIGTERM is ours now, agreed every every_n_steps, so its flag is never set: the broadcast goes.
        trainer.fit_loop.epoch_loop.__dict__["_broadcast_sigterm_tensor"] = lambda: None
        # A signal during the set-up (a compile, the sanity check): under several ranks all of them agree here, once
        # a run, whichever rank has it (a collective made by that rank alone would never be matched).
        if self.signum or trainer.world_size > 1:
            self._agree(trainer, pl_module, signals=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    on_sanity_check_start = on_validation_start

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)
        self._test_batches = 0
        self._agree_on_signal(trainer)  # one arrived between fit and test

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._test_batches += 1
        if trainer.world_size == 1 or self._test_batches % self.every_n_steps == 0:
            self._agree_on_signal(trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:  # fewer test batches than every_n_steps: a signal is still agreed on, and said
            self._agree_on_signal(trainer)

    def _agree_on_signal(self, trainer: L.Trainer) -> None:
        signum = float(self.signum)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            found = torch.full((1,), signum, device=trainer.strategy.root_device)  # no copy from the host
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            signum = found.item()
        if signum:
            write_metrics(trainer, Path(trainer.default_root_dir) / "test_metrics.json", status="interrupted")
            name = signal.Signals(int(signum)).name
            if trainer.is_global_zero:
                again = (
                    "training had finished; test it again with eval.py"
                    if self._trained
                    else "test again with the same command"
                )
                say(f"stopped by {name} during test: {again}")
            raise SystemExit(self._exit_code(trainer, 128 + int(signum)))

    def _exit_code(self, trainer: L.Trainer, code: int) -> int:
        # Children of Lightning's launcher end quietly: a non-zero exit would make it kill rank 0 mid-save. A node's
        # first process (local rank 0, started by hand with NODE_RANK) is the user's command, and exits as one.
        child = trainer.local_rank != 0 and type(_environment(trainer)).__name__ == "LightningEnvironment"
        return 0 if child else code

    @staticmethod
    def _reports(trainer: L.Trainer) -> bool:
        """Rank 0, and the first process of a node started by hand (NODE_RANK): each is a command someone ran."""
        by_hand = trainer.node_rank > 0 and type(_environment(trainer)).__name__ == "LightningEnvironment"
        return trainer.is_global_zero or (by_hand and trainer.local_rank == 0)

    def _save_last(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(_last_checkpoint(trainer))  # every rank: a sharded checkpoint needs all of them

    def _stop(self, trainer: L.Trainer, signum: int, epoch: int | None = None, saved: bool = False) -> None:
        """Saves last.ckpt (`saved`: it was, at the epoch's end), waits until every checkpoint is written, writes the
        metrics so far, says where to continue, exits. `epoch`: the one that ended, when the fit did."""
        path = _last_checkpoint(trainer)
        if self._in_step:
            _log_the_step_cut_short(trainer)
        if not saved:
            self._save_last(trainer)
        from engine.callbacks.checkpoint import wait_for_writes

        wait_for_writes(trainer)  # the epoch's own saves are written in the background: "saved" means written
        write_metrics(
            trainer, Path(trainer.default_root_dir) / "fit_metrics.json", "interrupted", _best_so_far(trainer)
        )
        name = signal.Signals(signum).name
        if self._reports(trainer):
            say(
                f"stopped by {name} at epoch {trainer.current_epoch if epoch is None else epoch}, step "
                f"{trainer.global_step}: saved {path}; continue with: {continue_command(path)}"
            )
        raise SystemExit(self._exit_code(trainer, 128 + signum))


def _lr_key(trainer: L.Trainer) -> str:
    """Where this run sets its learning rate (the run config RunState keeps): a module of one's own names its own key,
    not the template's model.optimizer.lr."""
    from engine.callbacks.run_state import RunState

    callbacks = getattr(trainer, "callbacks", [])
    config = next((c.config for c in callbacks if isinstance(c, RunState) and c.config), None)
    stack = [("model", (config or {}).get("model"))]
    while stack:
        path, node = stack.pop(0)
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("lr", "learning_rate") and isinstance(value, (int, float)):
                    return f"{path}.{key}"
                stack.append((f"{path}.{key}", value))
    return "the module's learning rate"


def _log_the_step_cut_short(trainer: L.Trainer) -> None:
    """A stop inside a step's end hooks comes before Lightning hands that step's logged values to the loggers: handed
    over here, or the stopped step's `train/loss_step` is never logged (a resume starts at the next step)."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


def _checkpoint_files(trainer: L.Trainer) -> list[Path]:
    """The checkpoints the run's checkpoint callbacks wrote, wherever their `dirpath` is, and <run>/checkpoints'."""
    folders = {Path(trainer.default_root_dir) / "checkpoints"}
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath and "://" not in str(dirpath):
            folders.add(Path(dirpath))
    return [path for folder in folders for path in folder.glob("*.ckpt")]  # files, or folders of shards (fsdp)


def _best_so_far(trainer: L.Trainer) -> dict[str, float]:
    """The monitor's best score so far (`best/val/acc`), as a finished fit records it: the sweep summary's column."""
    from engine.callbacks.monitor import Monitor
    from engine.runs.results import best_key

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, Monitor) and callback.best is not None:
            return {best_key(callback.metric): callback.best}
    return {}


def _last_checkpoint(trainer: L.Trainer) -> str:
    """Where resume looks: the LastCheckpoint callback's last.ckpt, or <run>/checkpoints/last.ckpt."""
    from engine.callbacks.checkpoint import LastCheckpoint

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, LastCheckpoint):
            return str(callback.path)
    return str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
