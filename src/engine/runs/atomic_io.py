"""Checkpoints written so a kill mid-save never leaves a torn file: Lightning moves a file from $TMPDIR without fsync
(a copy a kill can cut when /tmp is another filesystem). Here a hidden temp file beside it is fsynced, renamed, and
the dir fsynced; the callbacks' saves are written by a thread, in save order (benchmarks/per_call.py).
"""

import io
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO

from engine.errors import UserError

log = logging.getLogger(__name__)
_HOST = socket.gethostname()[:64]  # in a temporary file's name, before the writer's pid


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(checkpoint: dict[str, Any] | memoryview, target: Path) -> None:
    """torch.save (or the bytes it already made) to a hidden file beside `target`, fsync, rename over it, fsync the
    directory."""
    import torch

    partial = partial_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            if isinstance(checkpoint, memoryview):
                f.write(checkpoint)
            else:
                torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        _into_place(partial, target)
    except OSError as e:
        del checkpoint  # a snapshot is not kept alive by the error's traceback
        raise _not_written(target, e) from e
    finally:
        _remove(partial)


def copy_atomically(source: Path, target: Path) -> None:
    """`target` as `source`: a hard link renamed over it (checkpoint files are only ever replaced, never changed in
    place), or a fsynced copy where the filesystem has no links."""
    partial = partial_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, partial)
        except OSError:  # no hard links on this filesystem, or another filesystem
            _remove(partial)
            shutil.copyfile(source, partial)
            with open(partial, "rb+") as f:
                os.fsync(f.fileno())
        _into_place(partial, target)
    except OSError as e:
        raise _not_written(target, e) from e
    finally:
        _remove(partial)


def _into_place(partial: Path, target: Path) -> None:
    """The written temporary file renamed over `target`, the rename made durable, and killed writers' leftovers
    removed."""
    os.replace(partial, target)
    fsync_dir(target.parent)
    remove_stale_partials(target.parent)


def _not_written(target: Path, error: OSError) -> UserError:
    kept = "the previous one is unchanged" if target.exists() else "nothing was written there"
    return UserError(
        f"{target}: the checkpoint could not be written ({error.strerror or error}); {kept}. Make room or write "
        "elsewhere: paths.output_dir, or callbacks.model_checkpoint.dirpath and callbacks.last_checkpoint.dirpath"
    )


def _remove(partial: Path) -> None:
    """A temporary file gone, if there; errors ignored (even a missing one raises EROFS on a read-only filesystem,
    which must not hide the real error). One left behind goes later (remove_stale_partials)."""
    try:
        partial.unlink(missing_ok=True)
    except OSError:
        pass


def partial_path(target: Path) -> Path:
    """Where `target` is written before it is renamed into place: hidden, not `*.ckpt`, named by this machine and
    process, and short enough for any folder (a name may have 255 bytes; the target's own may use them all)."""
    return target.parent / f".{target.name[:150]}.partial-{_HOST}-{os.getpid()}"


def remove_stale_partials(folder: Path) -> None:
    """The temporary files of checkpoints (a whole checkpoint's size each) that processes of this machine killed
    mid-write left in `folder`. Those of a running process, or of another machine sharing the filesystem, stay."""
    for partial in folder.glob(".*.partial-*"):
        host, _, pid = partial.name.rsplit(".partial-", 1)[1].rpartition("-")
        if host == _HOST and pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            _remove(partial)  # one that cannot be removed (another user's) does not fail the write that was made


def _running(pid: int) -> bool:
    """Whether a process `pid` may be running here: only one that is surely gone says no."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; no pid at all, so not one of ours
        return True
    return True


def write_file(target: Path, write: Callable[[Path], object], fix: str) -> None:
    """`write(partial)` to a hidden file beside `target`, then renamed onto it: a full disk, a read-only folder or a
    kill leaves no torn `target`. A failure is one line ending with `fix`."""
    partial = target.parent / f".{target.stem}.partial-{os.getpid()}{target.suffix}"
    try:
        write(partial)
        os.replace(partial, target)
    except OSError as e:
        raise UserError(f"{target}: could not be written ({e.strerror or e}); {fix}") from e
    finally:
        _remove(partial)


def _first_failure(jobs: tuple[Future, ...]) -> BaseException | None:
    """The error of the first of `jobs` (all done) that failed."""
    return next((e for e in (job.exception() for job in jobs) if e is not None), None)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Local paths: written atomically, by the writer thread inside `in_background()`; others (`s3://...`): Lightning's.
    A checkpoint the run already read (`hand_over`) is not read again when Lightning restores it."""

    _handed: tuple[Path, dict] | None = None
    _background: Path | None = None  # the one file in_background() is for
    _writer: ThreadPoolExecutor | None = None
    _pending: tuple[Future, ...] = ()
    _newest_write: Future | None = None

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugins: a thread does not travel
        self.wait()
        return {k: v for k, v in self.__dict__.items() if k not in ("_writer", "_pending", "_newest_write")}

    @contextmanager
    def in_background(self, path: Any) -> Iterator[None]:
        """A save or removal of `path` inside goes to the writer thread, after those before it (the module
        docstring). Only that file's: a save a signal handler makes meanwhile (SLURM's requeue) is written at once."""
        self._background = Path(path)
        try:
            yield
        finally:
            self._background = None

    def _in_background(self, path: Any) -> bool:
        return self._background is not None and Path(path) == self._background

    def wait(self) -> None:
        """Until every save and removal handed to the writer thread is done; the first failure is raised here."""
        self._settle(len(self._pending))

    def _wait_for_older_writes(self) -> None:
        """Until the newest write handed over (and whatever came before it) is the only one left: the best file of
        an epoch may still be written while its last.ckpt is copied."""
        self._settle(self._pending.index(self._newest_write) if self._newest_write in self._pending else 0)

    def _settle(self, jobs: int) -> None:
        """Waits for the first `jobs` jobs handed over, in order; a failure is raised once (later jobs repeat or skip
        it). A Ctrl-C while waiting keeps the rest for teardown, which still reports their failure."""
        for _ in range(jobs):
            try:
                self._pending[0].result()
            except Exception:
                self._pending, self._newest_write = (), None  # nothing holds the failed snapshots any more
                raise
            self._pending = self._pending[1:]
        if not self._pending:
            self._newest_write = None

    def _submit(self, work: Callable[..., None], *args: Any, write: bool = False) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        future = self._writer.submit(work, *args)
        self._pending = (*self._pending, future)
        if write:
            self._newest_write = future

    def hand_over(self, path: str, checkpoint: dict) -> None:
        self._handed = (Path(path).expanduser().resolve(), checkpoint)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        handed, self._handed = self._handed, None
        if handed is not None and "://" not in str(path) and Path(path).expanduser().resolve() == handed[0]:
            return handed[1]
        return super().load_checkpoint(path, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path) or storage_options is not None:
            self.wait()
            return super().save_checkpoint(checkpoint, path, storage_options)
        if not self._in_background(path):
            self.wait()
            return write_atomically(checkpoint, Path(path))
        import torch

        self._before_a_background_write()
        snapshot = io.BytesIO()  # the state as it is now: the next steps change the weights
        torch.save(checkpoint, snapshot)
        self._submit(self._unless_failed, self._pending, write_atomically, snapshot.getbuffer(), Path(path), write=True)

    def save_copy(self, source: Any, path: Any) -> None:
        """`path` as the checkpoint file `source` this process saved just before (engine.callbacks.checkpoint:
        last.ckpt when the best file holds the same state): copy_atomically, after `source` is written."""
        if not self._in_background(path):
            self.wait()
            return copy_atomically(Path(source), Path(path))
        self._before_a_background_write()
        self._submit(self._unless_failed, self._pending, copy_atomically, Path(source), Path(path), write=True)

    def _before_a_background_write(self) -> None:
        self._wait_for_older_writes()  # so at most two copies in memory: the one being written and the next
        if any(future.done() and future.exception() for future in self._pending):
            self.wait()  # the epoch's best file failed to write: the run ends here, as it would have waited for it

    @staticmethod
    def _unless_failed(before: tuple[Future, ...], write: Callable[..., None], *args: Any) -> None:
        """`write(*args)` in the writer thread, unless a job before it failed (last.ckpt must not name a best file not
        on disk): then the failure is raised again, ending the run at the next save or teardown."""
        failed = _first_failure(before)
        if failed is not None:
            del args  # a snapshot is not kept alive by the traceback of the error raised again
            raise failed
        write(*args)

    def remove_checkpoint(self, path: Any) -> None:
        if self._in_background(path):  # after the save that replaces it, in the writer thread: never neither of them
            return self._submit(self._remove_unless_failed, self._pending, path)
        self.wait()
        super().remove_checkpoint(path)

    def _remove_unless_failed(self, before: tuple[Future, ...], path: Any) -> None:
        """A replaced file goes only once what replaces it is written (a full disk keeps the old best file)."""
        if _first_failure(before) is None:
            try:
                super().remove_checkpoint(path)
            except OSError as e:
                raise UserError(
                    f"{path}: the checkpoint a better one replaced could not be removed ({e.strerror or e}); the new "
                    "one is written. Remove it by hand, and let this run write in its checkpoints folder"
                ) from e

    def teardown(self) -> None:
        """Waits for the writer. While another error ends the run (a divergence, Ctrl-C), a failed write is logged
        rather than raised over it: that error says why the run ended, and sets its exit code."""
        writer, self._writer = self._writer, None
        ending = sys.exc_info()[1] is not None
        try:
            self.wait()
        except UserError as e:
            if not ending:
                raise
            log.error(str(e))
        finally:
            if writer is not None:
                writer.shutdown(wait=True)
