"""Stops a parallel sweep's worker once the sweep's own process is gone (kill -9, the OOM killer): otherwise a joblib
worker trained its job to the end for nobody, then waited minutes for work. The job stops as on SIGTERM (last.ckpt,
how to continue); the pid is handed down before the workers start, so a worker started just before the kill knows it.
"""

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from engine.errors import in_a_run, say

log = logging.getLogger(__name__)

SWEEP_PID = "PROJECT_SWEEP_PID"  # the sweep's process, set there before its workers start (they inherit it)
_WATCHING = False  # this worker's watcher is running


class SweepWatch(Callback):
    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = float(every_s)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ[SWEEP_PID] = str(os.getpid())

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _WATCHING
        sweep = int(os.environ.get(SWEEP_PID, os.getpid()))
        if _WATCHING or sweep == os.getpid():
            return  # watching already, or a job run in the sweep's own process
        _WATCHING = True
        threading.Thread(target=_watch, args=(sweep, self.every_s), name="sweep-watch", daemon=True).start()


def _gone(pid: int) -> bool:
    """`pid` has ended: no such process, or one that has ended and waits for its parent to collect it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's: the pid is in use
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def _watch(sweep: int, every_s: float) -> None:
    while not _gone(sweep):
        time.sleep(every_s)
    if in_a_run():
        say(f"the sweep's process (pid {sweep}) is gone: worker {os.getpid()} stops its job as a SIGTERM would")
        os.kill(os.getpid(), signal.SIGTERM)
        while in_a_run():  # the run saves last.ckpt and ends
            time.sleep(0.2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)  # no work can come to this worker any more
