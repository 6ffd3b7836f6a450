"""The single-file checkpoint writes themselves (engine.runs.atomic_io): their hidden temporary files, cleaned
up after processes killed mid-write, named within any folder's limits, and a read-only filesystem as one line."""

import os
from pathlib import Path

import pytest
import torch
from conftest import dead_pid

from engine.errors import UserError


def test_a_save_removes_the_temporary_files_that_killed_processes_left_beside_it(tmp_path):
    """`kill -9` during a write leaves its hidden temporary file (a whole checkpoint's size) beside the target;
    nothing ever removed them. The next successful write into that folder removes those of processes of this
    machine that are gone (of any checkpoint: a replaced best file's name does not come back), and keeps those of a
    running process (it may be writing) and of other machines (a shared filesystem: their processes cannot be seen
    from here)."""
    from engine.runs.atomic_io import _HOST, write_atomically

    dead, host = dead_pid(), _HOST  # this machine's name, as the temporary files carry it
    left = {
        "dead here": tmp_path / f".last.ckpt.partial-{host}-{dead}",
        "running here": tmp_path / f".last.ckpt.partial-{host}-{os.getppid()}",
        "another machine": tmp_path / f".last.ckpt.partial-node17-{dead}",
        "another file": tmp_path / f".epoch_001.ckpt.partial-{host}-{dead}",
        "no process's": tmp_path / f".last.ckpt.partial-{host}-99999999999999999999",  # crashed os.kill before
    }
    for path in left.values():
        path.write_bytes(b"PK\x03\x04 cut off")
    write_atomically({"global_step": 1}, tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"global_step": 1}
    assert {name for name, path in left.items() if path.exists()} == {"running here", "another machine", "no process's"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.partial") and str(os.getpid()) in p.name]


def test_a_read_only_filesystem_is_one_line_not_an_oserror_from_the_cleanup(tmp_path, monkeypatch):
    """On a read-only filesystem even removing a temporary file that was never made fails (EROFS, which
    `missing_ok` does not cover): that OSError replaced the one-line error, and Hydra printed its "Error executing
    job" report before it."""
    import builtins
    import errno

    from engine.runs.atomic_io import write_atomically, write_file

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(builtins, "open", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(UserError, match="could not be written \\(Read-only file system\\); nothing was written"):
        write_atomically({"global_step": 1}, tmp_path / "last.ckpt")
    with pytest.raises(UserError, match="fit_metrics.json: could not be written \\(Read-only file system\\)"):
        write_file(tmp_path / "fit_metrics.json", lambda partial: open(partial, "w"), "free space")


def test_a_checkpoint_with_the_longest_name_a_folder_allows_is_written_whatever_the_hostname(tmp_path, monkeypatch):
    """The temporary file's name adds the machine's name and the pid to the checkpoint's: with a long hostname (a
    cluster's fully qualified one) a long but valid checkpoint name made it longer than a folder allows."""
    from engine.runs import atomic_io

    assert len(atomic_io._HOST) <= 64  # the machine's name, cut to the length it may have at most in the name
    monkeypatch.setattr(atomic_io, "_HOST", ("gpu-node-0123.cluster-university-example-" * 2)[:64])
    target = tmp_path / ("n" * 240 + ".ckpt")
    atomic_io.write_atomically({"global_step": 3}, target)
    assert torch.load(target, weights_only=True) == {"global_step": 3}
    left = atomic_io.partial_path(target).with_name(f".{'n' * 150}.partial-{atomic_io._HOST}-{dead_pid()}")
    left.write_bytes(b"cut off")  # a killed writer's
    atomic_io.write_atomically({"global_step": 4}, target)
    assert not left.exists() and [p.name for p in tmp_path.iterdir()] == [target.name]
