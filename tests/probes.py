"""Test-only instruments for CLI tests: callbacks that write what each rank saw into $PROBE_DIR."""

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as L
import torch

from project.data.digits import DigitsDataModule


def fingerprint(image: torch.Tensor) -> str:
    return hashlib.sha1(image.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def probe_dir() -> Path:
    return Path(os.environ["PROBE_DIR"])


def run_seed(trainer) -> object:
    """The seed of the config this process runs (the run config every checkpoint carries)."""
    from engine.callbacks.run_state import RunState

    (found,) = [c for c in trainer.callbacks if isinstance(c, RunState)]
    return found.config.get("seed")


class SlowSetupDigits(DigitsDataModule):
    """Digits whose setup says so ($PROBE_DIR/setup_<rank>) and then takes 5 s: a window before the run's signal
    handlers are in place (a callback's setup comes after the data's)."""

    def setup(self, stage: str) -> None:
        rank = self.trainer.global_rank if self.trainer else 0
        (probe_dir() / f"setup_{rank}").write_text(str(os.getpid()))
        time.sleep(5)
        super().setup(stage)


class CountingDigits(DigitsDataModule):
    """Digits that append a line per prepare_data call, naming the calling rank."""

    def prepare_data(self) -> None:
        super().prepare_data()
        with open(probe_dir() / "prepare_data.calls", "a") as f:
            f.write(f"{self.trainer.global_rank if self.trainer else 'none'}\n")


class ShardProbe(L.Callback):
    """Per rank: the fingerprints of every training sample, per epoch, in order; the final metrics; and the
    seed of the config this rank runs. Writes rank<r>.json, or seed<s>_rank<r>.json in sweeps.

    $PROBE_FAIL_SEED=<s>: rank 1 of the run with that seed crashes in its third training step.
    """

    def __init__(self, per_seed: bool = False) -> None:
        self.seen: dict[int, list[str]] = {}
        self.per_seed = per_seed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, _ = batch
        self.seen.setdefault(trainer.current_epoch, []).extend(fingerprint(x) for x in images)
        seed = run_seed(trainer)
        if trainer.global_rank == 1 and batch_idx == 2 and str(seed) == os.environ.get("PROBE_FAIL_SEED"):
            raise RuntimeError(f"probe: rank 1 of the seed={seed} job fails on purpose")

    def on_fit_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        seed = run_seed(trainer)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pl_module.parameters())
        out = {
            "local_params": local,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "seed": seed,
            "pl_global_seed": os.environ.get("PL_GLOBAL_SEED"),
            "seen": self.seen,
            "metrics": metrics,
        }
        name = f"seed{seed}_rank{trainer.global_rank}" if self.per_seed else f"rank{trainer.global_rank}"
        (probe_dir() / f"{name}.json").write_text(json.dumps(out))


class EquivalenceProbe(L.Callback):
    """Rank 0 writes the loss of every step averaged over all ranks (the global-batch loss) and the
    final full weights (FSDP shards gathered) to $PROBE_DIR/losses.json and weights.pt."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))

    def on_fit_end(self, trainer, pl_module) -> None:
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in pl_module.net.state_dict().items()
        }
        if trainer.is_global_zero:
            (probe_dir() / "losses.json").write_text(json.dumps(self.losses))
            torch.save(state, probe_dir() / "weights.pt")


class PreemptionProbe(L.Callback):
    """At the start of epoch 1 of a run that did not resume, send this process SIGUSR1: what SLURM
    sends before preemption or timeout (#SBATCH --signal=SIGUSR1@90)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1 and trainer.ckpt_path is None:
            os.kill(os.getpid(), signal.SIGUSR1)
            if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
                time.sleep(30)  # Lightning's requeue: SLURM ends the job; here the fake scontrol does


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6 (Linux)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                found.append(".".join(str(b) for b in words[0]) if len(raw) == 4 else b"".join(words).hex())
    return found


class ListenProbe(L.Callback):
    """Rank 0 writes where the rendezvous store (MASTER_PORT) listens, while the run is live."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            port = int(os.environ["MASTER_PORT"])
            (probe_dir() / "listen.json").write_text(json.dumps(listening_addresses(port)))


class DtypeProbe(L.Callback):
    """Records the dtype of the net's output in training steps: what autocast really did."""

    seen: set[str] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.net.register_forward_hook(lambda module, args, out: DtypeProbe.seen.add(str(out.dtype)))


class KillAt(L.Callback):
    """$KILL_AT_STEP=<k> [$KILL_RANK=<r>, default 0]: that rank SIGKILLs itself as step k starts, as a
    scheduler's kill -9 or a lost node would, once the checkpoints saved before it are on disk (the writer thread
    finishes a save a few milliseconds after it was made), or at once with $KILL_WITHOUT_WAITING=1 (the newest
    save may then be lost; the one before is whole). $KILL_SIGNAL=<name> sends another signal (SIGTERM: a
    scheduler's stop). $STEP_SLEEP=<s> slows every step (time to send signals). $KILL_AT_HOOK: see below.
    $KILL_AT_BATCH=<n>: as this process's n-th training batch starts instead of a step.
    $HANG_AT_STEP=<k>: rank 1 waits forever in C as step k starts (a collective that another rank never joins)."""

    def on_train_start(self, trainer, pl_module) -> None:
        if "PROBE_DIR" in os.environ:
            (probe_dir() / f"pid_{trainer.global_rank}").write_text(str(os.getpid()))

    def _kill_at_hook(self, trainer, hook: str) -> None:
        """$KILL_AT_HOOK=on_fit_start|on_sanity_check_start: the signal comes before training starts (its set-up, a
        compile; a resumed run mid-epoch has no sanity check); on_test_batch_start: during the test after fit."""
        if os.environ.get("KILL_AT_HOOK") == hook and trainer.global_rank == int(os.environ.get("KILL_RANK", "0")):
            os.kill(os.getpid(), signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")])

    def on_fit_start(self, trainer, pl_module) -> None:
        self._kill_at_hook(trainer, "on_fit_start")

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._kill_at_hook(trainer, "on_sanity_check_start")

    def on_test_batch_start(self, trainer, pl_module, *args) -> None:
        self._kill_at_hook(trainer, "on_test_batch_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if "PROBE_DIR" in os.environ and trainer.global_step == 1:  # each rank's random state, read without drawing
            state = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
            (probe_dir() / f"rng_{trainer.global_rank}").write_text(f"{state} {batch[1].tolist()}")
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        hang_at = os.environ.get("HANG_AT_STEP")
        if hang_at is not None and trainer.global_step == int(hang_at) and trainer.global_rank == 1:
            (probe_dir() / "hanging").write_text(str(os.getpid()))
            torch.distributed.recv(torch.zeros(1), src=0)  # a message that never comes: this rank waits in C, and
            # rank 0 in the step's gradient all-reduce, as ranks whose data gives them unequal batch counts do
        self.batches = getattr(self, "batches", 0) + 1
        kill_at = os.environ.get("KILL_AT_STEP")
        if os.environ.get("KILL_AT_BATCH") == str(self.batches):  # this process's n-th batch, accumulated or not
            kill_at = str(trainer.global_step)
        if kill_at is not None and trainer.global_step == int(kill_at):
            if trainer.global_rank == int(os.environ.get("KILL_RANK", "0")):
                if not os.environ.get("KILL_WITHOUT_WAITING"):
                    trainer.strategy.checkpoint_io.wait()
                os.kill(os.getpid(), signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")])


class KillDuringSave(L.Callback):
    """$KILL_ON_SAVE=<n>: during the n-th checkpoint save, SIGKILL this process as soon as the save's
    temporary file or staging directory exists, that is, halfway through writing it."""

    def __init__(self) -> None:
        self.saves = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves += 1
        if self.saves != int(os.environ.get("KILL_ON_SAVE", "0")) or trainer.global_rank != 0:
            return
        checkpoint["ballast"] = torch.zeros(50_000_000)  # 200 MB: a save long enough to be caught halfway
        folder = Path(trainer.default_root_dir) / "checkpoints"

        def kill_when_writing() -> None:
            while True:
                if any(folder.glob(".*.partial-*")) or any(folder.glob(".*.staging")):
                    os.kill(os.getpid(), signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")])
                time.sleep(0.001)

        import threading

        threading.Thread(target=kill_when_writing, daemon=True).start()


class StepLosses(L.Callback):
    """Every training step's loss, as the step returned it (tests compare strategies step by step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class SignalAt(L.Callback):
    """$SIGNAL_AT=first_validation|last_validation|test: this process sends itself SIGTERM as the first or the last
    epoch's validation or the test starts its first batch (a scheduler's stop at a point between training steps,
    deterministically)."""

    def on_validation_batch_start(self, trainer, pl_module, *args) -> None:
        at = {"first_validation": 0, "last_validation": trainer.max_epochs - 1}.get(os.environ.get("SIGNAL_AT", ""))
        if trainer.current_epoch == at and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_test_batch_start(self, trainer, pl_module, *args) -> None:
        if os.environ.get("SIGNAL_AT") == "test":
            os.kill(os.getpid(), signal.SIGTERM)


class NanGradientAt(L.Callback):
    """$NAN_GRAD_AT_STEP=<k>: at step k one gradient becomes NaN while the loss stays finite (what a bad batch
    or an overflow in backward does): only the weights, after the optimizer's step, show it."""

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == int(os.environ.get("NAN_GRAD_AT_STEP", "-1")):
            next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(float("nan"))


class DiskGoneReadOnlyAt(L.Callback):
    """$READ_ONLY_AT_EPOCH=<e>: at the end of epoch e a write fails as on a disk remounted read-only mid-run."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == int(os.environ.get("READ_ONLY_AT_EPOCH", "-1")):
            import errno

            raise OSError(errno.EROFS, "Read-only file system", str(Path(trainer.default_root_dir) / "events.out"))


class DiskFullInCheckpointWritesAt(L.Callback):
    """$DISK_FULL_AT_EPOCH=<e>: from epoch e on, the checkpoint files' renames fail as on a full disk."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == int(os.environ.get("DISK_FULL_AT_EPOCH", "-1")):
            import errno
            import types

            from engine.runs import atomic_io

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            atomic_io.os = types.SimpleNamespace(**{**vars(os), "replace": full})


class GradModeProbe(L.Callback):
    """Makes Lightning choose its evaluation context as on GPUs (its gloo exemption off: torch.inference_mode unless
    the strategy says otherwise) and records, per rank, whether the test ran under inference_mode:
    $PROBE_DIR/grad_mode_rank<r>.json."""

    def __init__(self) -> None:
        import lightning.pytorch.loops.utilities as loops

        loops._distributed_is_initialized = lambda: False
        self.seen: dict[str, bool] = {}

    def on_test_batch_start(self, trainer, pl_module, *args) -> None:
        self.seen["test"] = torch.is_inference_mode_enabled()

    def on_test_end(self, trainer, pl_module) -> None:
        (probe_dir() / f"grad_mode_rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class SignalHandlers(L.Callback):
    """Writes $PROBE_DIR/handlers_<job>.txt when it is built, as the job starts, before the template's own handlers are
    installed: who handles SIGINT and SIGTERM as a sweep's job starts (what the job before it left)."""

    def __init__(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        found = [signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)]
        names = [getattr(handler, "__qualname__", repr(handler)) for handler in found]
        (probe_dir() / f"handlers_{HydraConfig.get().job.num}.txt").write_text(" ".join(names))


class MistakeAt(L.Callback):
    """$MISTAKE_AT_STEP=<n>, $MISTAKE_RANK=<r>: rank r alone finds a mistake (a UserError) at step n."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == int(os.environ["MISTAKE_AT_STEP"]):
            if trainer.global_rank == int(os.environ["MISTAKE_RANK"]):
                from engine.errors import UserError

                raise UserError(f"rank {trainer.global_rank} alone found a mistake at step {trainer.global_step}")
