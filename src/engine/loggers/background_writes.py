"""The writes of a tracker run, made in order by a thread of their own so that the training loop only queues them;
waiting for them is cut short by SIGTERM and SIGINT, which then reach their own handlers as before.
"""

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def _until_a_signal() -> Iterator[threading.Event]:
    """While the main thread waits for something a signal should cut short: an Event set by SIGTERM and SIGINT, which
    then reach their own handlers as before (the run's, which stop it; Python's, which raises KeyboardInterrupt)."""
    came = threading.Event()
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield came
        return
    before: dict[int, Any] = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        came.set()
        previous = before[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # what it would have done: end the process
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for signum, previous in before.items():
        if previous is not None and previous != signal.SIG_IGN:
            signal.signal(signum, handler)
    try:
        yield came
    finally:
        for signum, previous in before.items():
            if previous is not None and previous != signal.SIG_IGN:
                signal.signal(signum, previous)


class Writer:
    """The MLflow writes of one run, made in order by a daemon thread of their own: the training loop only queues
    them. The first one that fails is passed to `failed(error, what)` once, and every write after it is dropped."""

    def __init__(self, failed: Callable[[BaseException, str], None]) -> None:
        self._failed = failed
        self.error: BaseException | None = None
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, what: str, job: Callable[[], Any]) -> None:
        if self.error is not None:
            return
        with self._idle:
            self._pending += 1
        self._jobs.put((what, job))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlflow-writes", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            what, job = item
            try:
                if self.error is None:
                    job()
            except BaseException as e:  # whatever the store or the server did: the run goes on without them
                self.error = e
                self._failed(e, what)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait(self, limit: float | None) -> bool:
        """Until every queued write is made or dropped, at most `limit` seconds, never past a SIGTERM or SIGINT; then
        an idle thread ends (the next write starts another). True: all done."""
        deadline = None if limit is None else time.monotonic() + limit
        with _until_a_signal() as signalled, self._idle:
            while self._pending and not signalled.is_set():
                left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                if left <= 0:
                    break
                self._idle.wait(left)
            done = not self._pending
        if done and self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        return done
