"""The one exception type for mistakes a user can fix (config, paths, hardware), and how it ends a process."""

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


class UserError(Exception):
    """A bad input. The message says what is wrong and how to fix it; entry points print it as one line."""

    def __init__(self, message: str = "") -> None:
        # Raised in a DataLoader worker, it is rebuilt in the main process from a text with the worker's
        # traceback ("Caught UserError in DataLoader worker process 0. Original Traceback ..."): keep the message.
        if message.startswith("Caught ") and "Original Traceback" in message:
            message = message.rstrip().splitlines()[-1].split("UserError: ", 1)[-1]
        super().__init__(printable(message))


def printable(text: str) -> str:
    """`text` on one line whatever it quotes: line breaks, control characters and undecodable bytes (surrogate-escaped
    by the file system) are shown escaped (\\n, \\x1b, \\xff), so it prints on any terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in text)


def _escaped(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte os.fsdecode could not decode
        return f"\\x{code - 0xDC00:02x}"
    return ch.encode("unicode_escape").decode("ascii")


class SweepStopped(Exception):
    """What ends a whole sweep, not one job (its study's storage cannot be written): a job lets it through without
    recording a failure of its own, and the sweeper says it, once."""


class RunEnded(BaseException):
    """The run is over before its task's end, with `value` as its result (caught by engine.entry.run); a BaseException,
    so a task's `except Exception` does not take it for a failure."""

    def __init__(self, value: object = None) -> None:
        super().__init__(value)
        self.value = value


def exit_with(error: UserError) -> NoReturn:
    """`error: <message>` on stderr and exit code 2: how every refused run ends. SystemExit, unlike an
    exception, also passes through code that turns exceptions into warnings (Hydra's callbacks)."""
    say(f"error: {error}")
    raise SystemExit(2)


_in_a_run = False  # while engine.entry.run runs a task (run_log)


def say(line: str, console: bool = True) -> None:
    """The line that ends or stops a run, on stderr and, while a task runs, in the run's log file if still there (an
    unwritable one is skipped). `console=False`, and in a rank that rank 0 watches: the log file only."""
    import logging

    from engine.launch.environment import watched_rank

    line = printable(line)
    if console and not watched_rank():
        print(line, file=sys.stderr, flush=True)  # a process may end with os._exit next: no buffer is left behind
    if not _in_a_run:
        return
    record = logging.LogRecord("project", logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if not isinstance(handler, logging.FileHandler) or stream is None or not os.path.exists(handler.baseFilename):
            continue
        handler.acquire()
        try:
            stream.write(handler.format(record) + handler.terminator)
            stream.flush()
        except (OSError, ValueError):  # a full or read-only disk, a closed file: stderr has the line
            pass
        finally:
            handler.release()


def in_a_run() -> bool:
    """Whether a task is running in this process (engine.entry.run), in whichever thread asks."""
    return _in_a_run


@contextmanager
def run_log() -> Iterator[None]:
    """While a task runs (engine.entry.run): what `say` says also goes to its log file. Not before or after it: a
    sweep's own lines would land in the log of the job that ran last in the process."""
    global _in_a_run
    before, _in_a_run = _in_a_run, True
    try:
        yield
    finally:
        _in_a_run = before


def user_error_in(error: BaseException) -> UserError | None:
    """A UserError raised inside a resolver or a Hydra callback arrives wrapped by OmegaConf or Hydra."""
    return next((e for e in _chain(error) if isinstance(e, UserError)), None)


def user_error_in_traceback(text: str) -> UserError | None:
    """The UserError that a spawned process raised, from the traceback text that torch sends back in its place
    (ProcessRaisedException): the same class and message, to end the run as it would have ended in one process."""
    import importlib
    import re

    found = list(re.finditer(r"^(engine(?:\.\w+)+)\.(\w+): ", text, flags=re.MULTILINE))
    if not found or "Traceback (most recent call last)" in text[found[-1].end() :]:
        return None  # none, or not the error that ended the process (one raised while handling it did)
    module, name = found[-1].groups()
    try:
        kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(kind, type) and issubclass(kind, UserError)):
        return None
    return kind(" ".join(text[found[-1].end() :].split()))


def disk_error_in(error: BaseException) -> UserError | None:
    """A write a full or read-only disk stopped, as one line naming the file and the fix; None for an error raised
    while one was handled (a bug's traceback stays) or one already said as a UserError."""
    for e in _chain(error, causes_only=True):
        if isinstance(e, UserError):
            return None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            where = f"{os.fsdecode(e.filename)}: " if e.filename else "a file: "
            return UserError(
                f"{where}could not be written ({e.strerror or e}); make room, or write elsewhere: paths.output_dir"
            )
    return None


def missing_compile_backend_in(error: BaseException) -> UserError | None:
    """`model.compile=<backend>` whose package is not installed (tvm, openxla): torch says so only when the first
    batch compiles, deep in a traceback. One line naming the backend and the way out."""
    for e in _chain(error):
        inner = getattr(e, "inner_exception", None)
        if type(e).__name__ == "BackendCompilerFailed" and isinstance(inner, ImportError):
            name = getattr(e, "backend_name", "?")
            return UserError(
                f"model.compile={name}: that backend cannot run here ({type(inner).__name__}: "
                f"{' '.join(str(inner).split())}); install what it names, or use model.compile=true (inductor) or false"
            )
    return None


def unused_parameters_in(error: BaseException, strategy: str = "ddp") -> UserError | None:
    """DDP with a parameter that got no gradient in a step, in one line instead of Lightning's traceback on every
    rank; `strategy`: the run's ddp flavour (ddp, ddp_spawn, ddp_fork), which the fix names."""
    for e in _chain(error):
        if isinstance(e, RuntimeError) and "parameters that were not used in producing the loss" in str(e):
            return UserError(
                f"a parameter of the model got no gradient in a training step (a layer forward does not use), which "
                f"{strategy} needs unless told: remove what forward does not use, or pass "
                f"trainer.strategy={strategy}_find_unused_parameters_true (it searches the graph for them every step)"
            )
    return None


def _chain(error: BaseException | None, causes_only: bool = False) -> Iterator[BaseException]:
    """`error`, its cause (or context), theirs, ...; each once: a chain may lead back into itself (an error raised
    while another is reported, that one's cause: Lightning's logging on a disk made read-only)."""
    visited: set[int] = set()
    while error is not None and id(error) not in visited:
        yield error
        visited.add(id(error))
        error = error.__cause__ if causes_only else error.__cause__ or error.__context__
