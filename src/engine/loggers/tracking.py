"""What the experiment trackers (MLflow, W&B) share: the tracker run's ids kept in `<run>/trackers.json`, so a resumed
run (new run dir, reading `<run>`'s) or a requeued job (its own dir) continues it; its name, groups, sweep and package.
Imports nothing heavy: the config check imports the loggers' modules.
"""

import contextlib
import fcntl
import html
import importlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import UserError

FILE = "trackers.json"
INSTALL = 'pip install -e ".[trackers]"'


def require(module: str, logger: str) -> None:
    """`logger=<logger>` without its package: one line naming the install, not Lightning's ModuleNotFoundError."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"logger={logger} needs the {module} package ({e}); install it with: {INSTALL}") from e


def one_line(error: BaseException, limit: int = 300) -> str:
    """A tracker's or a storage's error (often several lines, a server's whole reply) as the tail of a one-line
    message: its type and `readable` text."""
    return f"{type(error).__name__}: {readable(str(error))[:limit]}"


def readable(text: str) -> str:
    """`text` as one readable line: SQLAlchemy's `[SQL: ...]` tail (passed on by MLflow and Optuna) dropped, an HTML
    page (a web server's 404) reduced to its words, whitespace collapsed."""
    text = re.split(r"\s*\[SQL: ", text, maxsplit=1)[0]  # the statement, then its parameters: the rest of the text
    text = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", text)
    text = re.sub(r"\(raised as a result of Query-invoked autoflush;[^)]*\)\s*", "", text)  # when, not what
    # urllib3's report of the last try, whose cause is what happened: "HTTPConnectionPool(host=..., port=...): Max
    # retries exceeded with url: /api/... (Caused by ReadTimeoutError("HTTPConnectionPool(...): Read timed out."))"
    retries = r"HTTPS?ConnectionPool\([^)]*\): Max retries exceeded with url: \S+ \(Caused by (\w+)\((.*)\)\)"
    text = re.sub(retries, _last_try, text, flags=re.DOTALL)
    if re.search(r"<\s*(!doctype|html|head|body)\b", text, flags=re.IGNORECASE):
        for hidden in ("head", "script", "style"):  # the title repeats the heading; code shows nothing
            text = re.sub(rf"<{hidden}\b.*?</{hidden}\s*>", " ", text, flags=re.IGNORECASE | re.DOTALL)
        text = html.unescape(re.sub(r"<[^>]*>?", " ", text))
    return " ".join(text.split())


def _last_try(match: re.Match[str]) -> str:
    """`ReadTimeoutError: Read timed out. (read timeout=8)`, from urllib3's cause of its last try."""
    said = re.sub(r"^(<[^>]*>|HTTPS?Connection(Pool)?\([^)]*\)): ", "", match.group(2).strip("\"'"))
    return f"{match.group(1)}: {said}"


def sweep_dir() -> str | None:
    """The sweep dir of a sweep job; None for a single run."""
    from hydra.core.hydra_config import HydraConfig

    from engine.sweeps.jobs import is_multirun

    return str(HydraConfig.get().sweep.dir) if is_multirun() else None


def run_name(run_dir: str) -> str:
    """A sweep job by what it changes (`model=mlp,seed=1`, as in TensorBoard), a single run by its dir's name
    (its start time)."""
    from engine.loggers.tensorboard import sweep_job_name

    return sweep_job_name() or Path(run_dir).name


def chosen_groups() -> dict[str, str]:
    """The config groups Hydra chose for this run (`model: lenet`, `model/optimizer: adam`), Hydra's own aside."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {
        str(group): str(choice)
        for group, choice in choices.items()
        if choice is not None and not str(group).startswith("hydra") and "@" not in str(group)
    }


def recall(directory: str | Path, tracker: str) -> dict[str, Any] | None:
    """The ids `tracker` left in `directory`, or None."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text()).get(tracker)
    except (ValueError, AttributeError) as e:
        raise UserError(f"{path}: not the JSON this project writes ({e}); remove it to start a new tracker run") from e
    return found if isinstance(found, dict) else None


def remember(directory: str | Path, tracker: str, ids: dict[str, Any]) -> None:
    """Add `tracker`'s ids to `directory`'s file, atomically (a kill leaves the old file or the new one)."""
    path = Path(directory) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.is_file() else {}  # one writer: rank 0, or the sweep's locker
    current[tracker] = ids
    partial = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(current, indent=1) + "\n")
    os.replace(partial, path)


def sqlite_file(url: str | None) -> Path | None:
    """The file of an sqlite store or storage (`sqlite:///<path>`), None for an in-memory one or another database."""
    path = Path(url.removeprefix("sqlite:///")) if url and url.startswith("sqlite:///") else None
    return None if path is None or str(path) in ("", ":memory:") else path


def remove_sqlite(path: Path) -> None:
    """A database this process created and could not finish, with sqlite's companions: nothing half-made is left."""
    for each in (path, *(path.with_name(path.name + end) for end in ("-journal", "-wal", "-shm"))):
        with contextlib.suppress(OSError):
            each.unlink()


def run_dir_of(ckpt_path: str) -> Path:
    """The run dir a checkpoint belongs to: `<run>/checkpoints/last.ckpt` and `<run>/hpc_ckpt_1.ckpt` -> `<run>`."""
    path = Path(ckpt_path).expanduser().resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def continued(tracker: str, run_dir: str, resume_from: str | None, resume: bool) -> dict[str, Any] | None:
    """The ids of the tracker run this run continues: a requeued job's own (its run dir has them), else those of
    the run `resume_from` (the checkpoint this run trains on from) belongs to; None for a new tracker run."""
    if not resume:
        return None
    own = recall(run_dir, tracker)
    if own is not None:
        return own
    return recall(run_dir_of(resume_from), tracker) if resume_from else None


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """An exclusive lock on `path` between processes (parallel sweep jobs creating one parent run or MLflow database);
    the holder removes the file before letting go, so none is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(path, "a")  # an empty file: no byte to write, so a full disk does not stop it
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        except BaseException:
            handle.close()
            raise
        if same_file(handle, path):
            break
        handle.close()  # its holder removed it: the lock is the file now at `path`
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # still held: whoever opened this file before waits, then sees it is gone
        handle.close()


def same_file(handle: Any, path: Path) -> bool:
    """Whether the open file `handle` is the file at `path` (not one removed, or replaced, since it was opened)."""
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
