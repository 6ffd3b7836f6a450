"""A real single-node SLURM cluster for the tests: this host as the one node, with its cores and memory.

`slurm_cluster` (a session fixture) writes a minimal slurm.conf into a temporary directory, starts `slurmctld -D`
and `slurmd -D` as children of the test process, waits for the node to be idle, exports SLURM_CONF (so sbatch,
srun, scontrol and squeue of this process and of every job talk to this cluster) and stops both at the end. Needs
Debian's `slurm-wlm` (22.05; `.ci/run` installs it); without it the tests that use it skip in one line. No root,
no systemd, no munge: `auth/none` and `cred/none`, no accounting database (so no `sacct`: a job's state is asked
with `scontrol show job`, which knows a job until MinJobAge after it ended).

Short timings: a requeued job is eligible again after cred_expire (5 s, SLURM's least), a job's tasks get SIGTERM
then SIGKILL KillWait (5 s) later, and the scheduler looks at the queue every second.
"""

import ctypes
import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SBIN = ("/usr/sbin", "/usr/local/sbin")  # where Debian puts the daemons: not on every user's PATH
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process dies, however it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


@dataclass
class Cluster:
    """The running cluster: its directory, and the few client commands the tests need."""

    root: Path
    node: str
    daemons: list[subprocess.Popen] = field(default_factory=list)
    started_in_s: float = 0.0

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit; the job id. `args`: sbatch's options, the script, then the script's arguments."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"sbatch {shlex.join(args)}: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        ).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def wait(self, job_id: str, timeout: float = 120, until: set[str] = ENDED, restarts: int = 0) -> dict[str, str]:
        """Poll the job until its state is in `until` after at least `restarts` restarts; its fields then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in until and int(info.get("Restarts", "0")) >= restarts:
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s\n{self.logs()}")

    def scontrol(self, *args: str) -> None:
        subprocess.run(["scontrol", *args], check=True, capture_output=True, timeout=30)

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], check=True, capture_output=True, timeout=30)

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{_tail(self.root / name)}" for name in ("slurmctld.log", "slurmd.log"))

    def idle(self) -> bool:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
        return proc.returncode == 0 and proc.stdout.strip() == "idle"

    def stop(self) -> None:
        """Cancel what still runs (its tasks are not our children), then end both daemons."""
        subprocess.run(["scancel", "--user", getpass.getuser()], capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
            if not out.strip():
                break
            time.sleep(0.2)
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def slurm_conf(root: Path, node_line: str, node: str, user: str) -> str:
    """The whole cluster: one node (`slurmd -C`'s line: this host's cores and memory), one partition."""
    return f"""\
ClusterName=pytest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
{node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    binaries = {name: _which(name) for name in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol")}
    missing = [name for name, path in binaries.items() if path is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): apt-get install slurm-wlm")
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    (root / "plugstack.conf").write_text("")
    node_line = subprocess.run(
        [str(binaries["slurmd"]), "-C"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    node = node_line.split()[0].removeprefix("NodeName=")
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node_line, node, getpass.getuser()))
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    # the daemons and every client see this cluster only: no variables of a SLURM job the tests may run in
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    cluster = Cluster(root, node)
    for name, args in (("slurmctld", ["-D", "-i"]), ("slurmd", ["-D", "-N", node])):
        with open(root / f"{name}.out", "w") as out:
            cluster.daemons.append(
                subprocess.Popen(
                    [str(binaries[name]), *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            )
    try:
        deadline = time.monotonic() + 30
        while not cluster.idle():
            if time.monotonic() > deadline or any(d.poll() is not None for d in cluster.daemons):
                raise RuntimeError(f"the test cluster's node never became idle\n{cluster.logs()}")
            time.sleep(0.1)
        cluster.started_in_s = time.monotonic() - started
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        shutil.rmtree(root, ignore_errors=True)
