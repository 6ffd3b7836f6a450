"""Real SLURM clusters for the tests, on this one host: the one-node `slurm_cluster`, and `slurm_nodes`, several.

`slurm_cluster` (a session fixture): this host as the one node, with its cores and memory (`slurmd -C`'s line). It
exports SLURM_CONF (so sbatch, srun, scontrol and squeue of this process and of every job talk to this cluster).

`slurm_nodes` (a module fixture): 2 nodes of 1 CPU each (`@pytest.mark.parametrize("slurm_nodes", [3],
indirect=True)` for another count), each its own `slurmd -N <node>` on this host, at its own port, with its own
spool dir, pid file and log. The nodes are named 127.0.0.1, 127.0.0.2, ...: a job's first node name resolves to an
address of this host, as node names do on a real cluster (Lightning's MASTER_ADDR is the first name of
SLURM_NODELIST). It exports nothing: its clients and jobs are given its SLURM_CONF (`Cluster.env`).

Each cluster writes a minimal slurm.conf into its own temporary directory, starts `slurmctld -D` and its `slurmd -D`
as children of the test process, waits for its nodes to be idle and stops them all at the end. Several can run at
once (pytest-xdist workers, or both fixtures in one worker): each has its own ports, directory, cluster name, and
block of 99 job ids held by a lock file while it lives, since Lightning's MASTER_PORT is 15000 + the last four
digits of the job id (two jobs of the same id on one host would meet at one port). Needs Debian's `slurm-wlm`
(22.05; `.ci/run` installs it); without it the tests that use it skip in one line. No root, no systemd, no munge:
`auth/none` and `cred/none`, no accounting database (so no `sacct`: a job's state is asked with `scontrol show
job`, which knows a job until MinJobAge after it ended).

Short timings: a requeued job is eligible again after cred_expire (5 s, SLURM's least), a job's tasks get SIGTERM
then SIGKILL KillWait (5 s) later, and the scheduler looks at the queue every second.
"""

import contextlib
import ctypes
import fcntl
import getpass
import os
import random
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
from typing import IO

import pytest

SBIN = ("/usr/sbin", "/usr/local/sbin")  # where Debian puts the daemons: not on every user's PATH
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol")
JOB_ID_BLOCKS = range(1, 100)  # block k: job ids 100k+1 .. 100k+99, Lightning's ports 15000 + 100k+1 ..


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (each bound, all at once, then released)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _job_id_block() -> tuple[int, IO[str]]:
    """A block of job ids no other live test cluster of this host has, and its lock file (held until closed)."""
    for block in random.sample(JOB_ID_BLOCKS, len(JOB_ID_BLOCKS)):
        lock = open(Path(tempfile.gettempdir()) / f"pytest-slurm-job-ids-{block}.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return block, lock
        except OSError:
            lock.close()
    raise RuntimeError("every block of job ids is held by a live test cluster")


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process dies, however it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


@dataclass
class Cluster:
    """The running cluster: its directory and nodes, and the few client commands the tests need."""

    root: Path
    nodes: list[str]
    daemons: list[subprocess.Popen] = field(default_factory=list)
    started_in_s: float = 0.0

    @property
    def node(self) -> str:
        return self.nodes[0]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment by default) with this cluster's SLURM_CONF."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=30)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit; the job id. `args`: sbatch's options, the script, then the script's arguments."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args], cwd=cwd, env=self.env(env), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"sbatch {shlex.join(args)}: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self._run("scontrol", "show", "job", "-o", job_id).stdout
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
        proc = self._run("scontrol", *args)
        assert proc.returncode == 0, f"scontrol {shlex.join(args)}: {proc.stderr}"

    def scancel(self, *args: str) -> None:
        proc = self._run("scancel", *args)
        assert proc.returncode == 0, f"scancel {shlex.join(args)}: {proc.stderr}"

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (idle, allocated, down, ...; `*`: not responding)."""
        out = self._run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def logs(self) -> str:
        names = ["slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes)]
        return "\n".join(f"--- {name}\n{_tail(self.root / name)}" for name in names)

    def idle(self) -> bool:
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def stop(self) -> None:
        """Cancel what still runs (its tasks are not our children), then end the daemons."""
        self._run("scancel", "--user", getpass.getuser())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not self._run("squeue", "-h", "-o", "%i").stdout.strip():
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


def slurm_conf(
    root: Path, name: str, host: str, port: int, node_lines: list[str], nodes: str, first_job_id: int, returns: int
) -> str:
    """The whole cluster: slurmctld on this host at `port`, its nodes (`node_lines`), one partition of them all;
    a DOWN node returns to service when its slurmd answers (`returns`=2), or only when it had stopped answering (1:
    one an admin set down stays down until `scontrol update state=resume`)."""
    user = getpass.getuser()
    return f"""\
ClusterName={name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
FirstJobId={first_job_id}
MaxJobId={first_job_id + 98}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
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
ReturnToService={returns}
KillWait=5
{chr(10).join(node_lines)}
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def running_cluster(nodes: int | None = None) -> Iterator[Cluster]:
    """A cluster for as long as the context lasts: None, this host as its one node (its cores and memory); a
    number, that many nodes of 1 CPU each, 127.0.0.1, 127.0.0.2, ..., each its own slurmd on this host. On several
    nodes, a node set down (`scontrol update nodename=<n> state=down reason=...`) stays down, as a failed one would,
    until `state=resume`."""
    binaries = {name: _which(name) for name in BINARIES}
    missing = [name for name, path in binaries.items() if path is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): apt-get install slurm-wlm")
    started = time.monotonic()
    host_line = subprocess.run(
        [str(binaries["slurmd"]), "-C"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    host = host_line.split()[0].removeprefix("NodeName=")
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    lock = None
    try:
        block, lock = _job_id_block()
        ctld_port, *ports = _free_ports(1 + (nodes or 1))
        if nodes is None:
            names, lines = [host], [f"{host_line} NodeAddr=127.0.0.1 Port={ports[0]} State=UNKNOWN"]
        else:
            memory = int(host_line.split("RealMemory=")[1].split()[0]) // nodes
            names = [f"127.0.0.{i + 1}" for i in range(nodes)]
            lines = [
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory={memory} "
                "State=UNKNOWN"
                for name, port in zip(names, ports, strict=True)
            ]
        (root / "state").mkdir()
        (root / "plugstack.conf").write_text("")
        cluster = Cluster(root, names)
        all_nodes = names[0] if nodes is None else "ALL"
        returns = 2 if nodes is None else 1  # several nodes: a node set down is a failed node until resumed
        conf = slurm_conf(root, f"pytest{block}", host, ctld_port, lines, all_nodes, 100 * block + 1, returns)
        cluster.conf.write_text(conf)
        # the daemons see this cluster only: no variables of a SLURM job the tests may run in
        env = {k: v for k, v in cluster.env().items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        commands = [("slurmctld", ["-D", "-i"]), *(("slurmd", ["-D", "-N", name]) for name in names)]
        try:
            for i, (daemon, args) in enumerate(commands):
                with open(root / f"daemon{i}.out", "w") as out:
                    cluster.daemons.append(
                        subprocess.Popen(
                            [str(binaries[daemon]), *args],
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent,
                        )
                    )
            deadline = time.monotonic() + 30
            while not cluster.idle():
                if time.monotonic() > deadline or any(d.poll() is not None for d in cluster.daemons):
                    raise RuntimeError(f"the test cluster's nodes never became idle\n{cluster.logs()}")
                time.sleep(0.1)
            cluster.started_in_s = time.monotonic() - started
            yield cluster
        finally:
            cluster.stop()
    finally:
        if lock is not None:
            lock.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """This host as a one-node cluster, SLURM_CONF exported for the whole session."""
    with running_cluster() as cluster:
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            yield cluster
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


@pytest.fixture(scope="module")
def slurm_nodes(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A cluster of 2 nodes (or `request.param`, by indirect parametrization) for the test module; SLURM_CONF is
    not exported: submit with `Cluster.sbatch`, give jobs `Cluster.env(...)`."""
    with running_cluster(getattr(request, "param", 2)) as cluster:
        yield cluster
