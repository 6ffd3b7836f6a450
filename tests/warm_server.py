"""The warm interpreter's server (tests/warm.py is its client): run as `python tests/warm_server.py <bytecode
folder>`, it imports the stack once, then serves requests, one JSON line each on stdin, each answered on stdout: a
run forked from it becomes `python <script> <args>` (`_become`). A zygote forked from it forks the runs that a run
starts of itself (tests/warm_rank.py stands in for those in the run).
"""

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
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
    "joblib.externals.loky",
    # what every run imports later, lazily: TensorBoard's writer (with protobuf), Hydra's core plugins (its plugin
    # discovery imports each), the interpolation grammar's analyzer, PIL's image formats
    "torch.utils.tensorboard",
    "torch.utils.serialization",
    "tensorboard.summary.writer.event_file_writer",
    "google_crc32c",
    "absl.flags",
    "hydra._internal.utils",
    "hydra._internal.logging_config",
    "hydra._internal.core_plugins.basic_launcher",
    "hydra._internal.core_plugins.basic_sweeper",
    "hydra._internal.core_plugins.bash_completion",
    "hydra._internal.core_plugins.fish_completion",
    "hydra._internal.core_plugins.zsh_completion",
    "hydra._internal.core_plugins.file_config_source",
    "hydra._internal.core_plugins.importlib_resources_config_source",
    "hydra._internal.core_plugins.structured_config_source",
    "hydra.experimental.callback",
    "hydra.experimental.compose",
    "hydra.experimental.initialize",
    "antlr4.LL1Analyzer",
    "PIL.BmpImagePlugin",
    "PIL.GifImagePlugin",
    "PIL.JpegImagePlugin",
    "PIL.PpmImagePlugin",
    "xml.dom.minidom",
)


_BYTECODE: str | None = None  # where runs keep what they compile: the client's folder, given to serve()


def _child(request: dict[str, Any], base_path: list[str], zygote: str) -> None:
    """In a process forked by the server: a run's stdout and stderr go to the files the client reads."""
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    _become(request, base_path, zygote)


def _become(request: dict[str, Any], base_path: list[str], zygote: str) -> None:
    """Become `python <argv[1:]>` (stdin, stdout and stderr already in place), and end as that interpreter would:
    non-daemon threads joined (threading's shutdown hooks first, which stop joblib's workers), atexit handlers
    run, streams flushed. Then it leaves without tearing down every module torch and Lightning loaded, which takes
    a cold config error's run a second longer than the whole run; nothing of this project or its stack needs that
    teardown."""
    code: int = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        os.setpgrp()  # its own process group, as a shell would give it: a signal to the group reaches its ranks
        _start_ranks_warm(zygote)
        if _BYTECODE is not None:
            # The project's modules compiled once for the server's runs, not at each (PYTHONDONTWRITEBYTECODE may be
            # set), into the client's folder: nothing is written beside the sources
            sys.pycache_prefix, sys.dont_write_bytecode = _BYTECODE, False
        argv = request["argv"][1:]
        if argv[0] == "-u":  # unbuffered, as submitit starts its jobs
            argv = argv[1:]
            sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
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


def _start_ranks_warm(zygote: str) -> None:
    """`python [-u] <script.py> ...` started by the run (Lightning's launcher for DDP's other ranks, torchrun's
    workers, a sweep's job in a fresh process), and joblib's workers (`python -m ...` with pipes kept open), run
    through tests/warm_rank.py, forked from the zygote: warm too, the same argv, cwd, env and descriptors.
    Everything else the run starts starts as it would."""
    real = subprocess.Popen
    stand_in = str(Path(__file__).with_name("warm_rank.py"))

    class Popen(real):  # type: ignore[valid-type,misc]
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            if (
                isinstance(args, (list, tuple))
                and len(args) > 1
                and args[0] == sys.executable
                and str(args[2 if args[1] == "-u" and len(args) > 2 else 1]).endswith(".py")  # torchrun adds -u
                and not kwargs.get("pass_fds")
            ):
                args = [sys.executable, "-I", "-S", stand_in, zygote, *args[1:]]
            super().__init__(args, *rest, **kwargs)

    subprocess.Popen = Popen  # type: ignore[misc]

    from joblib.externals.loky.backend import fork_exec as loky

    real_fork_exec = loky.fork_exec

    def fork_exec(cmd: list[str], keep_fds: Any, env: Any = None) -> int:
        """joblib's workers: `python -m joblib.externals.loky.backend.popen_loky_posix --pipe <fd> ...`."""
        if len(cmd) > 2 and cmd[0] == sys.executable and cmd[1] == "-m":
            cmd = [sys.executable, "-I", "-S", stand_in, zygote, *cmd[1:]]
        return real_fork_exec(cmd, keep_fds, env)

    loky.fork_exec = fork_exec


def _put_fds(received: list[int], numbers: list[int]) -> None:
    """Each received descriptor at the number it had in the stand-in (moved out of the way first: a received one
    may sit at another's number)."""
    import fcntl

    above = max([*received, *numbers]) + 1  # not a fixed number: it must stay below the open-file limit
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(high, numbers, strict=True):
        os.dup2(fd, number)
        os.close(fd)


def _start(
    listener: socket.socket, selector: Any, clients: dict[int, socket.socket], base: list[str], name: str
) -> None:
    """Fork the process a stand-in asks for and tell it the pid. A stand-in killed on the way (before it sent its
    request, or before it read the pid) costs only its own process, never the zygote."""
    conn, _ = listener.accept()
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 250)
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        try:
            for other in (listener, *clients.values(), conn):
                other.close()
            selector.close()
            _put_fds(fds, request["fds"])
            _become(request, base, name)
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    clients[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        _drop(pid, selector, clients)


def _drop(pid: int, selector: Any, clients: dict[int, socket.socket]) -> None:
    conn = clients.pop(pid, None)
    if conn is not None:
        selector.unregister(conn)
        conn.close()
    for kill in (os.kill, os.killpg):  # the process, and what it started in its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _zygote(listener: socket.socket, base_path: list[str], zygote: str) -> None:
    """Forked from the server once the imports are paid: forks a process for each stand-in that connects, tells it
    the pid and, when that process ends, how. A stand-in that goes away (killed outright) takes its process along."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the server, however it goes
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                _start(listener, selector, clients, base_path, zygote)
                continue
            try:
                gone = not key.fileobj.recv(1)  # type: ignore[union-attr]
            except OSError:  # reset by a stand-in killed outright
                gone = True
            if gone:  # the stand-in is gone: its process goes too
                _drop(key.data, selector, clients)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in clients:
                conn = clients.pop(pid)
                selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


def _warm_up_parsers() -> None:
    """OmegaConf's interpolation grammar and Hydra's override grammar (ANTLR) build their prediction tables as they
    parse; built here once, not in every run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import grammar_parser

    for text in ("${a.b}", "${..n}", "${oc.select:a,null}", "${r:${a},x}", "x/${a}_${b:%Y}", "[1,2]", "a b", "1e-3"):
        grammar_parser.parse(text)
    overrides = ["a=1", "b.c=[1,2]", "+d=x", "~e", "f=1,2", "g=choice(1,2)", "h=interval(0,1)", "i/j=k", "l='m n'"]
    OverridesParser.create().parse_overrides(overrides)


def serve(bytecode: str | None = None) -> None:
    import importlib

    global _BYTECODE
    _BYTECODE = bytecode

    for name in PRELOAD:
        importlib.import_module(name)
    _warm_up_parsers()
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path if p and p not in pythonpath and p != os.path.dirname(os.path.abspath(__file__))]
    zygote = f"warm-{os.getpid()}"  # the name of an abstract socket: no file to leave behind
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + zygote)
    listener.listen(64)
    zygote_pid = os.fork()
    if zygote_pid == 0:
        _zygote(listener, base_path, zygote)
    listener.close()
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the channel
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base_path, zygote)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)
    os.kill(zygote_pid, signal.SIGKILL)
    os.waitpid(zygote_pid, 0)  # reaped: the CPU time of what it forked counts as this process's children's


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else None)
