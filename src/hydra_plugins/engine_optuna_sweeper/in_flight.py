"""Trials kept in flight one by one, so a slow trial never idles the other workers (Hydra #3091).

Hydra's sweepers hand the launcher a batch of n_jobs jobs and wait for the whole batch. Here each trial's job is
launched alone, `launcher.launch([job], trial number)`, from a thread of its own, and the sweeper asks the study
for the next trial as soon as any job returns. Only launchers whose jobs run in other processes and that take
concurrent launch() calls qualify (CONCURRENT): joblib's launcher does, as each call runs its one job on loky's
shared pool of worker processes (joblib reuses the pool while its arguments stay the same), so the pool keeps
n_jobs workers busy. joblib stops the whole pool when one worker dies (or a job raises past Hydra's run_job): the
other jobs running then come back as exceptions too, and their trials are recorded as failed with that reason.
Hydra's basic launcher runs jobs in this process (one HydraConfig, one working directory): trials there keep going
one batch after the other.
"""

import queue
import threading
from typing import Any, Union

from hydra.core.utils import JobReturn

# Launchers known to take concurrent launch() calls, by class name (imported only when one is configured).
CONCURRENT = ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",)


def concurrent(launcher: Any) -> bool:
    """True when `launcher` can run trials one by one from several threads."""
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(launcher).__mro__}
    return bool(names.intersection(CONCURRENT))


class InFlight:
    """The trials whose jobs are running, each launched from its own thread; `next_done` waits for any of them.

    A job that the launcher could not bring back (its worker process died, the pool was shut down) comes back
    as the exception the launcher raised, so the sweeper records that trial as failed and goes on."""

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
