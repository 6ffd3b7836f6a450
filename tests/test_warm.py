"""tests/warm.py: a process a warm run starts of itself (`python <script.py>` as DDP's launcher does, joblib's
workers) is forked from the zygote, and the run that started it sees what it would see of a cold `python`: the argv,
working directory, environment and descriptors it gave, the exit code or the signal it died of, and signals passed
on. A stand-in killed outright takes its process along: no rank is left running."""

import os
import signal
import sys
import time
from pathlib import Path

from conftest import WARM

LAUNCHER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "child.py", "a b", "--x=1"], cwd="sub", env={**os.environ, "CHILD_VAR": "1"})
print("stand-in", child.args[:4], file=sys.stderr)
mode = sys.argv[1]
if mode == "signal":
    while not os.path.exists("sub/pid"):
        time.sleep(0.01)
    child.send_signal(signal.SIGUSR1)  # the child exits 7 on SIGUSR1
elif mode == "kill":
    while not os.path.exists("sub/pid"):
        time.sleep(0.01)
    child.kill()  # SIGKILL to the stand-in: nothing can pass it on
print(child.wait(), flush=True)
"""

CHILD = """
import os, signal, sys, time
import torch  # already imported in the zygote: no 2 s import
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))
print(sys.argv[1:], os.getcwd().endswith("sub"), os.environ["CHILD_VAR"], "torch" in sys.modules)
open("pid.tmp", "w").write(str(os.getpid()))
os.replace("pid.tmp", "pid")
if os.environ.get("CHILD_MODE") == "exit":
    sys.exit(3)
if os.environ.get("CHILD_MODE") == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _run(tmp_path: Path, mode: str, child_mode: str = "") -> tuple[int, list[str], str]:
    (tmp_path / "sub").mkdir()
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "sub" / "child.py").write_text(CHILD)
    env = {**os.environ, "CHILD_MODE": child_mode}
    proc = WARM.run([sys.executable, "launcher.py", mode], tmp_path, env, timeout=60)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def _gone(pid: int, within: float = 5) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_child_gets_argv_cwd_env_and_streams_and_its_exit_code_comes_back(tmp_path):
    code, out, err = _run(tmp_path, "wait", child_mode="exit")
    assert code == 0 and out == ["['a b', '--x=1'] True 1 True", "3"]
    assert "warm_rank.py" in err  # it did go through the stand-in


def test_a_child_killed_by_a_signal_is_seen_killed_by_that_signal(tmp_path):
    code, out, _ = _run(tmp_path, "wait", child_mode="die")
    assert code == 0 and out[-1] == str(-signal.SIGKILL)


def test_a_signal_to_the_stand_in_reaches_the_child(tmp_path):
    code, out, _ = _run(tmp_path, "signal")
    assert code == 0 and out[-1] == "7"


def test_a_stand_in_killed_outright_takes_its_child_along(tmp_path):
    code, out, _ = _run(tmp_path, "kill")
    assert code == 0 and out[-1] == str(-signal.SIGKILL)
    assert _gone(int((tmp_path / "sub" / "pid").read_text()))


JOBLIB = """
import os, sys
from joblib import Parallel, delayed

def worker(i):
    return i, os.getpid(), "torch" in sys.modules  # this script imports no torch: only a warm worker has it

print(sorted(Parallel(n_jobs=2, backend="loky")(delayed(worker)(i) for i in range(4))))
"""


def test_joblibs_workers_are_forked_warm_and_run_the_jobs(tmp_path):
    (tmp_path / "jobs.py").write_text(JOBLIB)
    proc = WARM.run([sys.executable, "jobs.py"], tmp_path, dict(os.environ), timeout=60)
    assert proc.returncode == 0, proc.stderr
    results = eval(proc.stdout.strip().splitlines()[-1])
    assert [i for i, _, _ in results] == [0, 1, 2, 3]
    assert all(warm for _, _, warm in results)
    assert len({pid for _, pid, _ in results} - {os.getpid()}) in (1, 2)  # joblib's worker processes


def test_a_stand_in_gone_before_its_request_leaves_the_zygote_serving(tmp_path):
    """A stand-in killed between connecting and sending (a timeout's killpg, SLURM's KillWait) cost the zygote its
    loop: every later rank of the test worker failed to start."""
    import socket

    WARM.run([sys.executable, "-c", "pass"], tmp_path, dict(os.environ), timeout=60)  # the server is up
    assert WARM.server is not None
    for _ in range(3):
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        gone.connect(f"\0warm-{WARM.server.pid}")
        gone.close()
    code, out, _ = _run(tmp_path, "wait", child_mode="exit")
    assert code == 0 and out[-1] == "3"


def test_what_a_child_prints_after_the_run_ended_is_in_its_streams(tmp_path):
    """A cold run's pipes reach their end only once every process writing to them has ended: a rank that prints
    its error a moment after rank 0 exited is in the output (a pipeline test missed it under load)."""
    (tmp_path / "late.py").write_text(
        "import subprocess, sys\n"
        "code = 'import sys, time; time.sleep(0.5); print(\"late\", file=sys.stderr)'\n"
        "subprocess.Popen([sys.executable, '-c', code])\n"
        "print('early', file=sys.stderr)\n"
    )
    proc = WARM.run([sys.executable, "late.py"], tmp_path, dict(os.environ), timeout=60)
    assert proc.returncode == 0 and proc.stderr.split() == ["early", "late"]


def test_modules_are_compiled_once_into_a_folder_of_their_own_and_again_when_changed(tmp_path):
    """Warm runs keep the bytecode of what they import (the project's modules, compiled again at every run before)
    in the client's private folder, whatever PYTHONDONTWRITEBYTECODE says, and never beside the sources."""
    (tmp_path / "main.py").write_text("import mod\nprint(mod.VALUE)\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    compiled = WARM.bytecode / str(tmp_path).lstrip("/") / f"mod.{sys.implementation.cache_tag}.pyc"
    outputs, stamps, written = [], [], None
    for value in ("1", "1", "22"):  # the same source again: its bytecode is read, not written again; then another
        (tmp_path / "mod.py").write_text(f"VALUE = {value}\n")  # source of another size in the same second
        if written is None:
            written = (tmp_path / "mod.py").stat().st_mtime_ns
        os.utime(tmp_path / "mod.py", ns=(written, written))
        proc = WARM.run([sys.executable, "main.py"], tmp_path, env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.strip())
        stamps.append(compiled.stat().st_mtime_ns)
    assert outputs == ["1", "1", "22"]
    assert stamps[0] == stamps[1] < stamps[2]  # compiled, reused, compiled again
    assert not (tmp_path / "__pycache__").exists()
