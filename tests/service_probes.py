"""Callbacks the service-failure tests add to their runs by target: a service stopped, a disk filled, names logged."""

# Lightning only: a run that imports this module (tests/ is on its PYTHONPATH) pays for nothing more.
import errno
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as L


class SignalServiceAt(L.Callback):
    """$SERVICE_PGID, $SERVICE_SIGNAL (SIGSTOP: the server accepts and never answers), $AT_EPOCH: the signal goes
    to the service's process group as that epoch starts; then $MARKER is written, if set."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == int(os.environ["AT_EPOCH"]):
            os.killpg(int(os.environ["SERVICE_PGID"]), getattr(signal, os.environ["SERVICE_SIGNAL"]))
            if os.environ.get("MARKER"):
                Path(os.environ["MARKER"]).write_text("sent")


def fill(folder: Path) -> None:
    """Writes folder/filler until the disk under it is full."""
    with open(folder / "filler", "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


class FillDiskAt(L.Callback):
    """$FILL_DIR's disk filled as epoch $FILL_AT_EPOCH starts (of trial $FILL_AT_TRIAL's job, if set: its next report
    to the pruner fails), or when the test of the sweep job of trial $FILL_AT_TRIAL ends (its last report to the
    study made, its result not yet told)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        trial = os.environ.get("FILL_AT_TRIAL")
        if trainer.current_epoch == int(os.environ.get("FILL_AT_EPOCH", "-1")) and (
            trial is None or os.environ.get("HYDRA_OPTUNA_TRIAL_NUMBER") == trial
        ):
            fill(Path(os.environ["FILL_DIR"]))

    def on_test_end(self, trainer, pl_module) -> None:
        trial = os.environ.get("FILL_AT_TRIAL")
        if (
            trial is not None
            and "FILL_AT_EPOCH" not in os.environ
            and os.environ.get("HYDRA_OPTUNA_TRIAL_NUMBER") == trial
        ):
            fill(Path(os.environ["FILL_DIR"]))


class LogNamed(L.Callback):
    """Logs 1.0 under each name of the JSON list $METRIC_NAMES, every training step."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        for name in json.loads(os.environ["METRIC_NAMES"]):
            pl_module.log(name, 1.0)
