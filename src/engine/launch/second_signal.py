"""A second Ctrl-C or SIGTERM ends the process at once, nothing saved. The first is the run's to act on (a checkpoint,
then exit: engine.callbacks.checks), but Python runs its handlers only between bytecodes: a process blocked in C, such
as ranks waiting in a collective that another rank never joins, would ignore every signal until the collective's
timeout (30 minutes). The C-level handler writes each signal's number to the wakeup fd at once; a thread reads it.
"""

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from engine.errors import say

STOPS = (signal.SIGINT, signal.SIGTERM)
# The same stop sent twice at once is one stop: a terminal's Ctrl-C reaches every process of its group, and a launcher
# (torchrun, ddp_spawn's main process) passes its own on to the same processes milliseconds later.
APART_S = 1.0
_children: list[Any] = []  # processes this one started (subprocess.Popen): ended with it
_pipe: list[int] = []  # (read end, write end) while armed


def _not_in_a_fork() -> None:
    """A forked child (a DataLoader's worker) keeps its parent's handlers and wakeup fd: the signals it gets (Ctrl-C,
    its loader's terminate) would be counted as the parent's own."""
    if _pipe:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for fd in _pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        _pipe.clear()
        _children.clear()


os.register_at_fork(after_in_child=_not_in_a_fork)


def end_with_this_process(procs: list[Any]) -> None:
    """Ranks this process started and watches (engine.launch.ranks): a forced exit takes them along."""
    _children.extend(procs)


def _watch(read_fd: int, disarmed: threading.Event) -> None:
    first: float | None = None
    while True:
        try:
            data = os.read(read_fd, 64)  # blocks without the GIL: runs while the main thread waits in C
        except OSError:
            return
        if disarmed.is_set():
            return
        for signum in data:
            if signum not in STOPS:
                continue
            now = time.monotonic()
            if first is None or now - first < APART_S:
                first = first or now
                continue
            _end_now(signal.Signals(signum))


def _end_now(stop: signal.Signals) -> None:
    import multiprocessing

    for child in [*_children, *multiprocessing.active_children()]:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            child.kill()
    say(
        f"stopped at once by a second {stop.name}: the first was not acted on yet (a process waiting on another "
        "rank, or in a long call); nothing was saved now, the run's last checkpoint is where to continue from"
    )
    os._exit(128 + stop)


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """While a task runs in the main thread: a second stop signal at least APART_S after the first ends the process."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler never blocks on a full pipe
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    _pipe[:] = [read_fd, write_fd]
    disarmed = threading.Event()
    watcher = threading.Thread(target=_watch, args=(read_fd, disarmed), daemon=True, name="second-signal")
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        disarmed.set()
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the watcher, which returns
        watcher.join(timeout=5)
        for fd in _pipe:
            os.close(fd)
        _pipe.clear()
        _children.clear()
