"""A warm interpreter for the CLI tests: `python <script> <args>` run exactly as the interpreter would run it (the
same argv, working directory, environment and module search path; exit code, stdout and stderr as files), in a
process forked from one that has already imported torch, Lightning, Hydra and the rest of the stack.

A run of `train.py` spends most of its time importing (about 5 s of CPU here, README *Performance*); the tests run
hundreds of them. The server imports only third-party packages, never this project's, so each run imports the
project from wherever its own PYTHONPATH says (the README tests run a fresh copy of the repository). Each run is its
own forked process: nothing of one run (signals, seeds, Hydra's global state, environment) reaches the next, and
the server runs no torch operation, so no thread pool exists to be broken by the fork. Processes a run starts
itself (DDP's other ranks) start cold, as they would for a user.

Run as `python tests/warm.py`, it serves requests, one JSON line each on stdin, and answers each on stdout.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# What the server imports before it forks: everything a run imports that is not this project.
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "torchmetrics",
    "torchvision",
    "hydra",
    "omegaconf",
    "numpy",
    "PIL.Image",
    "tensorboard",
)


def _child(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked process: become `python <argv[1:]>`, and end as that interpreter would: non-daemon threads
    joined (threading's shutdown hooks first, which stop joblib's workers), atexit handlers run, streams flushed.
    Then it leaves without tearing down every module torch and Lightning loaded, which takes a cold config error's
    run a second longer than the whole run; nothing of this project or its stack needs that teardown."""
    code: int = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(os.devnull, "rb") as null:
            os.dup2(null.fileno(), 0)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        os.setpgrp()  # its own process group, as a shell would give it: a signal to the group reaches its ranks
        argv = request["argv"][1:]
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        import runpy

        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[:] = [str(Path(argv[0]).resolve().parent), *extra, *base_path]
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    try:
        import atexit
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter runs first at exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path if p and p not in pythonpath and p != os.path.dirname(os.path.abspath(__file__))]
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the channel
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base_path)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


class Warm:
    """The client: one server per test process, started on first use."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.server: subprocess.Popen | None = None
        self.files = Path(tempfile.mkdtemp(prefix="warm-"))  # stdout and stderr of runs: not in their cwd

    def _start(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [self.python, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
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
        finally:
            timer.cancel()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if expired.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            assert self.server.stdin is not None
            self.server.stdin.close()
            self.server.wait(timeout=30)
        shutil.rmtree(self.files, ignore_errors=True)


if __name__ == "__main__":
    serve()
