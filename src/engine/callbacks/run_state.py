"""What every checkpoint carries beyond Lightning's: the resolved run config (plain containers, so weights_only=True
loads it) and every rank's random state, which Lightning's lack (a resume would draw other dropout masks). Restored
in `on_train_start`, the last hook before the first batch; one callback, since each costs every step a few µs.
"""

import random
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from engine.runs.checkpoints import CONFIG_KEY


def _capture(device: torch.device) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # Python's 625 words as one tensor: as a tuple of ints they were a third of the objects torch.save visits
        "python": (version, torch.tensor(words, dtype=torch.int64), gauss),
        # numpy's own state holds an ndarray, which torch.load(weights_only=True) refuses: store it as a tensor
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    words = words.tolist() if isinstance(words, torch.Tensor) else words  # a tuple in checkpoints before 2026-11-25
    random.setstate((version, tuple(words), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank(rank: int) -> None:
    """Each rank its own random stream from the run's seed and the rank (Lightning gives all ranks one seed, so the
    same masks); rank 0 keeps the run's own. Called after the model is built, so replicas start with equal weights."""
    import os

    seed = os.environ.get("PL_GLOBAL_SEED")
    if rank == 0 or seed is None:  # unseeded: every process drew its own state from the OS already
        return
    derived = np.random.SeedSequence([int(seed), rank]).generate_state(2)
    random.seed(int(derived[0]))
    np.random.seed(int(derived[1]))
    torch.manual_seed((int(derived[0]) << 32) | int(derived[1]))


def _plateau_values(trainer: L.Trainer) -> dict[str, float]:
    """The values the ReduceLROnPlateau schedulers watch, as they are now: Lightning steps them at an epoch's end from
    these, after that epoch's checkpoints are saved, and a resumed run has none of them."""
    found = {}
    for config in trainer.lr_scheduler_configs:
        value = trainer.callback_metrics.get(config.monitor) if config.reduce_on_plateau and config.monitor else None
        if value is not None:
            found[str(config.monitor)] = float(value)
    return found


def _step_plateaus(trainer: L.Trainer, values: dict[str, float], epoch: int) -> None:
    """The epoch-end steps Lightning takes of the plateau schedulers (frequency, monitor, the module's hook)."""
    for config in trainer.lr_scheduler_configs:
        due = config.interval == "epoch" and (epoch + 1) % config.frequency == 0
        value = values.get(config.monitor) if config.monitor else None
        if config.reduce_on_plateau and due and value is not None:
            trainer.lightning_module.lr_scheduler_step(config.scheduler, value)


class RunState(L.Callback):
    """Saves the run `config` (if given) and the torch, numpy, Python and CUDA random states of every rank;
    restores each rank's own random state on resume. Steps the plateau schedulers Lightning skips on resume."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config
        self._loaded: list[dict[str, Any]] | None = None
        self._plateau: dict[str, float] = {}  # the values the plateau schedulers watched when the checkpoint was saved
        self._pending_epoch: int | None = None  # the epoch whose plateau step the checkpoint came before
        self._trainer: L.Trainer | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.config is not None:
            checkpoint[CONFIG_KEY] = self.config

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        mine = _capture(device)
        plateau: dict[str, Any] = {}
        if trainer is not None:
            # saved in an epoch's end hooks: Lightning takes that epoch as done on resume, without its plateau step
            progress = trainer.fit_loop.epoch_progress.current
            pending = trainer.current_epoch if getattr(progress, "processed", 0) > progress.completed else None
            plateau = {"values": _plateau_values(trainer), "pending_epoch": pending}
        if trainer is None or trainer.world_size == 1:
            return {"ranks": [mine], "plateau": plateau}
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)  # every rank saves: dump_checkpoint runs on all
        return {"ranks": gathered, "plateau": plateau}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict.get("ranks")
        plateau = state_dict.get("plateau") or {}
        self._plateau, self._pending_epoch = dict(plateau.get("values", {})), plateau.get("pending_epoch")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning skips the plateau step at the end of the epoch a run resumed in: taken here from the epoch's own
        # values or, without them (resumed after the epoch's validation), the saved ones
        if trainer.fit_loop.restarting and trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            _step_plateaus(trainer, {**self._plateau, **_plateau_values(trainer)}, trainer.current_epoch)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seed_rank(trainer.global_rank)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pending, self._pending_epoch = self._pending_epoch, None
        if pending is not None and not trainer.fit_loop.restarting:
            _step_plateaus(trainer, self._plateau, pending)
        states, self._loaded = self._loaded, None
        if states is None:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint holds the random state of {len(states)} processes, this run has "
                f"{trainer.world_size}: random draws continue from fresh states, not exactly as before."
            )
            return
        _restore(states[trainer.global_rank], trainer.strategy.root_device)
