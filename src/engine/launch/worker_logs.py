"""Logging in the processes ddp_spawn starts, which begin with none configured: a worker logs where the process that
started it does (rank 0 into the run's log and the console, rank r into `<task>_ddp_process_<r>.log`, as ddp's)."""

import logging
import sys
from pathlib import Path
from typing import Any

Described = tuple[
    int, list[tuple[str | None, str | None, int]]
]  # the root's level, and (file or stream, format, level)


def describe() -> Described:
    """This process's root log handlers, in a form a spawned process can be given (a file, or stdout/stderr)."""
    root = logging.getLogger()
    handlers: list[tuple[str | None, str | None, int]] = []
    for handler in root.handlers:
        fmt = handler.formatter._fmt if handler.formatter is not None else None
        if isinstance(handler, logging.FileHandler):
            handlers.append((handler.baseFilename, fmt, handler.level))
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            handlers.append(("<stderr>" if handler.stream is sys.stderr else "<stdout>", fmt, handler.level))
    return root.level, handlers


def recreate(described: Described, rank: int) -> None:
    """In a spawned worker: the handlers `describe` found, for this rank (the console for rank 0 alone)."""
    from engine.console import one_console_output

    level, handlers = described
    root = logging.getLogger()
    root.setLevel(level)
    for where, fmt, handler_level in handlers:
        handler: Any
        if where in ("<stdout>", "<stderr>"):
            if rank:
                continue
            handler = logging.StreamHandler(sys.stderr if where == "<stderr>" else sys.stdout)
        else:
            path = Path(str(where))
            if rank:
                path = path.with_name(f"{path.stem}_ddp_process_{rank}{path.suffix}")
            handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter(fmt))
        handler.setLevel(handler_level)
        root.addHandler(handler)
    one_console_output()  # Lightning's own console handlers, which it added on import, leave the printing to these
