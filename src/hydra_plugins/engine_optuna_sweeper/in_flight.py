"""Trials kept in flight one by one, so a slow trial never idles the other workers (Hydra #3091): Hydra's sweepers
wait for a whole batch of n_jobs. Each job is launched alone from its own thread, for launchers that take concurrent
launch() calls (CONCURRENT: joblib's, on loky's shared pool); the basic launcher keeps going batch after batch.
"""

import queue
import threading
from typing import Any, Union

from hydra.core.utils import JobReturn

# Launchers known to take concurrent launch() calls, by class name (imported only when one is configured).
CONCURRENT = ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",)


def _names(launcher: Any) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(launcher).__mro__}


def concurrent(launcher: Any) -> bool:
    """True when `launcher` can run trials one by one from several threads."""
    return bool(_names(launcher).intersection(CONCURRENT))


def in_this_process(launcher: Any) -> bool:
    """True when `launcher` runs each job in the sweeper's own process (Hydra's basic launcher)."""
    return "hydra._internal.core_plugins.basic_launcher.BasicLauncher" in _names(launcher)


class InFlight:
    """The trials whose jobs are running, each launched from its own thread; `next_done` waits for any of them. A
    job the launcher could not bring back returns as its exception, so that trial is recorded as failed."""

    def __init__(self, launcher: Any) -> None:
        self._launcher = launcher
        self._done: "queue.Queue[tuple[Any, Union[JobReturn, BaseException]]]" = queue.Queue()
        self._running: dict[int, tuple[Any, list[str]]] = {}  # trial number -> (optuna Trial, its job's overrides)

    def __len__(self) -> int:
        return len(self._running)

    def trials(self) -> list[Any]:
        return [trial for trial, _ in self._running.values()]

    def start(self, trial: Any, overrides: list[str]) -> None:
        self._running[trial.number] = (trial, overrides)
        # a daemon: a sweep that stops (Ctrl-C, an error) does not wait here for jobs it has given up on
        threading.Thread(target=self._run, args=(trial, overrides), name=f"trial-{trial.number}", daemon=True).start()

    def _run(self, trial: Any, overrides: list[str]) -> None:
        result: Union[JobReturn, BaseException]
        try:
            result = self._launcher.launch([overrides], initial_job_idx=trial.number)[0]
        except BaseException as e:  # handed to the sweeper's thread: it records the trial as failed
            result = e
        self._done.put((trial, result))

    def next_done(self) -> tuple[Any, list[str], Union[JobReturn, BaseException]]:
        """The next trial whose job has ended, its job's overrides, and its JobReturn (or what the launcher raised)."""
        trial, result = self._done.get()
        _, overrides = self._running.pop(trial.number)
        return trial, overrides, result


class LostJob(Exception):
    """A job the launcher raised on instead of returning it: its worker process died, or the pool went down."""
