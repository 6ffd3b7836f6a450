"""Pins each worker of a parallel sweep (hydra/launcher=parallel) to its own GPUs or share of CPU cores. A GPU must be
chosen before CUDA starts and loky workers keep theirs across jobs, so the pin belongs to the worker: its first job
takes a free slot by a non-blocking lock on `<sweep dir>/.slots/slot<i>.lock`, held for the process's life.
"""

import fcntl
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from engine.errors import UserError, exit_with

log = logging.getLogger(__name__)

_HELD: tuple[int, IO[str]] | None = None  # this process's slot and its locked file


@dataclass(frozen=True)
class Pin:
    """What a worker process was given: its slot, its GPU ids and its CPU cores."""

    slot: int
    gpus: list[str]
    cores: list[int]


_PIN: Pin | None = None  # set by the first job this process runs


def claim_slot(n_slots: int, lock_dir: Path) -> int:
    """The slot this process holds, claiming the first free one on the first call."""
    global _HELD
    if _HELD is not None:
        return _HELD[0]
    lock_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(n_slots):
        handle = open(lock_dir / f"slot{slot}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        _HELD = (slot, handle)
        return slot
    raise UserError(f"all {n_slots} device slots in {lock_dir} are taken: more workers than hydra.launcher.n_jobs")


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without starting CUDA: CUDA_VISIBLE_DEVICES, else /dev/nvidia<N>."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    return sorted((p.name[6:] for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)), key=int)


def share(items: list[Any], slot: int, n_slots: int, interleave: bool) -> list[Any]:
    """Slot `slot`'s part of `items`: every n-th (GPUs) or a contiguous block (cores); at least one item."""
    if interleave:
        return items[slot::n_slots] or [items[slot % len(items)]]
    k = max(1, len(items) // n_slots)
    return items[slot * k : slot * k + k] or [items[slot % len(items)]]


class DeviceSlots(Callback):
    """`slots`: the launcher's n_jobs. `gpus`: auto (use GPUs when there are any), true, or false (CPU only)."""

    def __init__(self, slots: int, gpus: Any = "auto") -> None:
        self.slots, self.gpus = int(slots), gpus

    def _gpus(self) -> list[str]:
        if self.gpus is False:
            return []
        found = visible_gpus()
        if self.gpus is True and not found:
            raise UserError("hydra.callbacks.device_slots.gpus=true, but no GPU is visible")
        return found

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse more parallel jobs than GPUs before any job starts (raising here would only warn)."""
        gpus = self._gpus()
        if gpus and self.slots > len(gpus):
            exit_with(
                UserError(
                    f"hydra.launcher.n_jobs={self.slots}: only {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}; "
                    "run at most one job per GPU"
                )
            )

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _PIN
        if _PIN is None:  # the first job of this worker process: claim a slot and its devices for good
            slot = claim_slot(self.slots, Path(HydraConfig.get().sweep.dir) / ".slots")
            gpus = self._gpus()
            _PIN = Pin(
                slot,
                share(gpus, slot, self.slots, interleave=True) if gpus else [],
                share(sorted(os.sched_getaffinity(0)), slot, self.slots, interleave=False),
            )
            os.sched_setaffinity(0, _PIN.cores)
        if _PIN.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_PIN.gpus)
        os.environ["OMP_NUM_THREADS"] = str(len(_PIN.cores))  # for processes the job starts (DDP ranks)
        import torch

        torch.set_num_threads(len(_PIN.cores))
        log.info(
            f"device slot {_PIN.slot} of {self.slots} (pid {os.getpid()}): "
            f"GPUs {','.join(_PIN.gpus) or 'none'}, CPU cores {','.join(map(str, _PIN.cores))}"
        )
