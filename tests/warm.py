"""A warm interpreter for the CLI tests: `python <script> <args>` run exactly as the interpreter would run it (the
same argv, working directory, environment and module search path; exit code, stdout and stderr as files), in a
process forked from one that has already imported torch, Lightning, Hydra and the rest of the stack.

A run of `train.py` spends most of its time importing (about 5 s of CPU here, README *Performance*); the tests run
hundreds of them. The server imports only third-party packages, never this project's, so each run imports the
project from wherever its own PYTHONPATH says (the README tests run a fresh copy of the repository). Each run is its
own forked process: nothing of one run (signals, seeds, Hydra's global state, environment) reaches the next, and
the server runs no torch operation, so no thread pool exists to be broken by the fork. A run that starts
`python <script.py>` again (Lightning's launcher for DDP's other ranks, a sweep job in a fresh process), and a
parallel sweep's joblib workers, get a warm process too: a zygote forked from the server forks it, and
tests/warm_rank.py stands in for it in the run (same argv, cwd, environment and open file descriptors; signals
passed on; its exit code or signal mirrored); so do torchrun's workers when torchrun runs warm, and a SLURM job's
srun tasks through `Warm.python_on_path`.

This is the client; the server it starts, and what a run does in it, is tests/warm_server.py.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = Path(__file__).with_name("warm_server.py")


def _running_in_group(group: int) -> bool:
    """Whether a process of process group `group` is still running (not a zombie)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False  # the common case: nothing of the run is left
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def _wait_for_group(group: int, expired: threading.Event, grace_s: float = 30) -> None:
    """As a pipe's reader waits for every writer: the ranks a run started may still be printing after it ended.
    What is still running after `grace_s` is killed (a test must not leave processes behind)."""
    deadline = time.monotonic() + grace_s
    while not expired.is_set() and _running_in_group(group):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            return
        time.sleep(0.02)


class Warm:
    """The client: one server per test process, started on first use."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.server: subprocess.Popen | None = None
        self.files = Path(tempfile.mkdtemp(prefix="warm-"))  # stdout and stderr of runs: not in their cwd
        self.bytecode = self.files / "bytecode"  # what the runs compile (a private folder, removed at close)

    def _start(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [self.python, str(SERVER), str(self.bytecode)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            assert self.server.stdout is not None
            assert json.loads(self.server.stdout.readline()).get("ready"), "the warm interpreter did not start"
        return self.server

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        server = self._start()
        assert server.stdin is not None and server.stdout is not None
        out, err = self.files / "stdout", self.files / "stderr"
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        pid = json.loads(server.stdout.readline())["pid"]
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            try:
                os.killpg(pid, signal.SIGKILL)  # the run and the processes it started
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            returncode = json.loads(server.stdout.readline())["returncode"]
            _wait_for_group(pid, expired)
        finally:
            timer.cancel()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if expired.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def python_on_path(self) -> Path:
        """A folder for the front of PATH whose `python` runs warm (through tests/warm_rank.py and this server's
        zygote): for processes started outside a warm run that call `python` by name, as a SLURM job's srun
        tasks do."""
        server = self._start()
        folder = self.files / f"bin-{server.pid}"
        if not folder.is_dir():
            folder.mkdir()
            stand_in = Path(__file__).with_name("warm_rank.py")
            shim = folder / "python"
            shim.write_text(f'#!/bin/sh\nexec "{self.python}" -I -S "{stand_in}" warm-{server.pid} "$@"\n')
            shim.chmod(0o755)
        return folder

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            assert self.server.stdin is not None
            self.server.stdin.close()
            self.server.wait(timeout=30)
        shutil.rmtree(self.files, ignore_errors=True)
