"""Ranks started outside Lightning: torchrun, several "nodes" on localhost; SLURM's variables parsed (srun on a real
cluster: tests/test_slurm.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS, WARM, run_dirs, run_python

from engine.errors import UserError
from engine.launch import environment as cluster
from engine.launch import processes

TRAIN = REPO / "train.py"
RUN = [
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "model=mlp",
    "debug=limit",
    "~callbacks.early_stopping",
    "+callbacks.probe._target_=probes.ShardProbe",
]
SLURM_VARS = (
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_NAME",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NNODES",
    "TORCHELASTIC_RUN_ID",
    "WORLD_SIZE",
)


@pytest.fixture
def clean_env(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_shared_run_name_comes_from_the_launcher(clean_env):
    assert cluster.shared_run_name() is None
    clean_env.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert cluster.shared_run_name() == "torchrun_abc"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")  # static rendezvous, no id: never one dir for every launch
    assert cluster.shared_run_name() == f"torchrun_{os.uname().nodename}-{os.getppid()}"
    clean_env.delenv("TORCHELASTIC_RUN_ID")
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_JOB_ID", "77")
    clean_env.setenv("SLURM_JOB_NAME", "train")
    assert cluster.shared_run_name() is None  # the batch script itself: one process, see test_dirs
    assert cluster.slurm_batch_job() == "77"
    clean_env.setenv("SLURM_STEP_ID", "4294967294")  # SLURM's id of the batch step
    assert cluster.shared_run_name() is None
    clean_env.setenv("SLURM_STEP_ID", "2")  # an srun step: every task of it shares the name
    assert cluster.shared_run_name() == "slurm_77_2" and cluster.slurm_batch_job() is None
    clean_env.setenv("SLURM_JOB_NAME", "bash")  # an interactive allocation: not a launch
    assert cluster.shared_run_name() is None


def test_dp_is_one_machine(clean_env):
    with pytest.raises(UserError, match="set trainer.num_nodes=1"):
        processes.check_process_count(2, 2, "dp")


def test_devices_must_match_what_the_launcher_started(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    clean_env.setenv("WORLD_SIZE", "4")
    processes.check_process_count(2, 2, "ddp")
    processes.check_process_count("auto", 1, "ddp")
    with pytest.raises(UserError, match=r"torchrun started 4 processes, but trainer.devices=2 x trainer.num_nodes=1"):
        processes.check_process_count(2, 1, "ddp")
    with pytest.raises(UserError, match="use trainer.strategy=ddp"):
        processes.check_process_count(4, 1, "ddp_spawn")
    with pytest.raises(UserError, match="dp runs its own processes, but torchrun already started 4"):
        processes.check_process_count(4, 1, "dp")
    for forked in ("ddp_fork", "ddp_notebook_find_unused_parameters_true", "ddp_spawn_find_unused_parameters_false"):
        with pytest.raises(UserError, match=f"trainer.strategy={forked} runs its own processes"):
            processes.check_process_count(4, 1, forked)
    processes.check_process_count(4, 1, "ddp_find_unused_parameters_true")  # started by torchrun: fine
    clean_env.delenv("TORCHELASTIC_RUN_ID")
    for k, v in {"SLURM_NTASKS": "8", "SLURM_JOB_NAME": "t", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}.items():
        clean_env.setenv(k, v)
    processes.check_process_count(4, 2, "ddp")
    with pytest.raises(UserError, match="--ntasks-per-node=2"):
        processes.check_process_count(2, 2, "ddp")
    with pytest.raises(UserError, match="trainer.num_nodes=2"):
        processes.check_process_count(4, 1, "ddp")
    clean_env.delenv("SLURM_NTASKS_PER_NODE")  # `srun -n 8`: Lightning's error spoke of a bash script's --ntasks
    with pytest.raises(UserError, match="srun started 8 tasks without --ntasks-per-node, .* srun --ntasks-per-node=8"):
        processes.check_process_count(4, 2, "ddp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """`cmd` from a fresh working directory `cwd`, without any launcher variables of the test's own shell."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    full.update(PYTHONPATH=str(TESTS), **env)
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def warm(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`cmd` as `start` runs it, to its end, in the warm interpreter (tests/warm.py): torchrun's workers are forked
    warm too."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    full.update(PYTHONPATH=str(TESTS), **env)
    return run_python(cmd, cwd, full, timeout=300)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def ranks(probe: Path) -> list[dict]:
    return [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]


def assert_two_ranks_split_the_data(probe: Path) -> list[dict]:
    seen = ranks(probe)
    assert sorted(p.name for p in probe.iterdir()) == ["rank0.json", "rank1.json"]  # no third process
    assert [r["world_size"] for r in seen] == [2, 2]
    assert not set(seen[0]["seen"]["0"]) & set(seen[1]["seen"]["0"])
    assert seen[0]["metrics"]["val/acc"] == seen[1]["metrics"]["val/acc"]
    return seen


@pytest.mark.slow
def test_torchrun_starts_the_ranks_and_lightning_launches_none(tmp_path):
    probe, logs = tmp_path / "probe", tmp_path / "logs"
    probe.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(TRAIN),
        "trainer.devices=2",
        *RUN,
    ]
    proc = warm(cmd, {"PROBE_DIR": str(probe)}, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    seen = assert_two_ranks_split_the_data(probe)
    assert {r["environment"] for r in seen} == {"TorchElasticEnvironment"}
    (run,) = run_dirs(logs)
    assert run.name.startswith("torchrun_") and (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_torchrun_with_the_wrong_device_count_stops_with_the_fix(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(TRAIN),
        "trainer.devices=1",
        *RUN,
    ]
    proc = warm(cmd, {"PROBE_DIR": str(tmp_path)}, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: torchrun started 2 processes, but trainer.devices=1 x trainer.num_nodes=1 = 1" in out


@pytest.mark.slow
def test_two_nodes_on_localhost_one_process_each(tmp_path):
    probe, run = tmp_path / "probe", tmp_path / "shared_run"
    probe.mkdir()
    port, python = str(free_port()), str(WARM.python_on_path() / "python")  # both nodes warm
    procs = [
        start(
            [python, str(TRAIN), f"hydra.run.dir={run}", "trainer.devices=1", "trainer.num_nodes=2", *RUN],
            {"PROBE_DIR": str(probe), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)},
            tmp_path,
        )
        for node in (0, 1)
    ]
    finish(procs)
    seen = assert_two_ranks_split_the_data(probe)
    assert [r["node_rank"] for r in seen] == [0, 1]
    assert (run / "checkpoints" / "last.ckpt").is_file()


RANK_SCRIPT = """
import os, time, types
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from engine.strategies import rendezvous

env = TorchElasticEnvironment()
rank = env.global_rank()
strategy = types.SimpleNamespace(
    _process_group_backend="gloo", _timeout=timedelta(seconds=60), root_device=torch.device("cpu"),
    cluster_environment=env, global_rank=rank, world_size=env.world_size(), num_nodes=1, node_rank=0,
    set_world_ranks=lambda: None, _get_process_group_backend=lambda: "gloo",
)
if os.environ.get("AFTER"):  # start once the other rank waits, and a while after
    while not Path(os.environ["AFTER"]).exists():
        time.sleep(0.02)
    time.sleep(1)
Path(os.environ["READY"]).touch()
rendezvous.connect(strategy, 60)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print("sum", total.item())
"""


@pytest.mark.slow
def test_torchrun_restarts_never_meet_the_previous_attempts_addresses(tmp_path):
    """torchrun's agent keeps one store for every restart of its workers (the shared c10d store), so the keys of a
    killed attempt's process group are still there when the next attempt starts. A restarted rank that read rank 0's
    old address stopped with gloo's (or NCCL's) "Connection refused" in about half of all `--max-restarts` restarts
    (pytorch#135712): whether it connects or waits to be connected depends on the two ports. Rank 1 starts first
    here, as it did in those restarts."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what torchrun's agent hosts
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    python = str(WARM.python_on_path() / "python")

    def rank(r: int, attempt: int, **extra: str) -> subprocess.Popen:
        env = {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(agent.port),
            "TORCHELASTIC_RUN_ID": "restarts",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": "1",
            "READY": str(tmp_path / f"ready{r}-{attempt}"),
            **extra,
        }
        return start([python, str(script)], env, tmp_path)

    decoy = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    decoy.set("project/token", "not-this-attempts")
    for attempt in range(2):
        if attempt:  # a live store at the published port, of someone else: not taken
            agent.set("project/store_of_this_attempt", f"{decoy.port} this-attempts-rank-0-never-wrote-this")
        first = rank(1, attempt) if attempt else rank(0, attempt)
        second = rank(0, attempt, AFTER=str(tmp_path / f"ready1-{attempt}")) if attempt else rank(1, attempt)
        try:
            outs = [p.communicate(timeout=60)[0] for p in (first, second)]  # hung before, when not refused
        finally:
            for p in (first, second):
                p.kill()
        assert [out.split()[-1] for out in outs] == ["3.0", "3.0"], (attempt, outs)


def test_an_address_rank_0_cannotlisten_on_is_one_line_naming_what_was_given():
    """Under torchrun rank 0 hosts its store on a free port of MASTER_ADDR: the line named MASTER_PORT=0, which
    nobody set, and asked for a free port."""
    from engine.strategies.rendezvous import listen_on

    with pytest.raises(UserError) as given:
        listen_on("192.0.2.1", 29500)  # TEST-NET-1: never an address of this machine
    assert "MASTER_ADDR=192.0.2.1 MASTER_PORT=29500" in str(given.value)
    with pytest.raises(UserError) as free:
        listen_on("192.0.2.1", 0, torchrun=True)
    assert "MASTER_PORT" not in str(free.value) and "MASTER_ADDR=192.0.2.1" in str(free.value)
    assert "an address of this machine" in str(free.value)


def test_a_one_machine_run_meets_on_a_free_port_below_the_ephemeral_range(monkeypatch):
    """Lightning's MASTER_PORT is an ephemeral port, unbound until rank 0 listens on it: meanwhile any outgoing
    connection on the machine may take it as its source port ("Address already in use", seen once in `make test`).
    The ranks started also inherit the mark that leaves the console to rank 0, which rank 0 itself does not keep
    (the processes it starts later, a test's CLI runs in pytest's process, are not watched)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from engine.launch import environment, ports, ranks

    monkeypatch.delenv("MASTER_PORT", raising=False)  # conftest restores what the launcher sets
    given: list[int] = []
    watched_by: list[str | None] = []  # the mark of the process that watches ranks 1..N-1, as they inherit it

    def start_ranks() -> None:
        given.append(launcher.cluster_environment.main_port)
        watched_by.append(os.environ.get(environment.WATCHED_BY))

    launcher = ranks.RankWatchingLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    monkeypatch.setattr(launcher, "_call_children_scripts", start_ranks)
    assert launcher.launch(lambda: "rank 0's work") == "rank 0's work"
    assert watched_by == [str(os.getpid())] and not environment.watched_rank()
    (port,) = given  # what the other ranks are started with, and rank 0's store listens on
    assert environment.WATCHED_BY not in os.environ  # in the environment the ranks got, not in this process's
    assert ports.LOWEST <= port < ports.ephemeral_start() and os.environ["MASTER_PORT"] == str(port)
    with socket.create_server(("127.0.0.1", port)):  # free
        pass

    monkeypatch.setenv("MASTER_PORT", "29517")  # a port the user named is kept
    launcher = ranks.RankWatchingLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    monkeypatch.setattr(
        launcher, "_call_children_scripts", lambda: given.append(launcher.cluster_environment.main_port)
    )
    launcher.launch(lambda: None)
    assert given[-1] == 29517


@pytest.mark.slow
@pytest.mark.parametrize(
    ("port", "expected"),
    [("abc", "error: MASTER_PORT='abc' is not a port number (1-65535)"), ("", "error: MASTER_PORT='' is not a port"),
     ("held", "error: cannot listen on MASTER_ADDR=127.0.0.1 MASTER_PORT=")],
)  # fmt: skip
def test_a_master_port_rank_0_cannot_use_is_refused_before_any_other_rank_starts(tmp_path, port, expected):
    """Refused after rank 1 had started, a held port left it waiting on whatever held the port (6 minutes and more,
    in a hostile test); a value that is no port number ended in Lightning's traceback."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        value = str(held.getsockname()[1]) if port == "held" else port
        env = {**os.environ, "MASTER_PORT": value, "PROJECT_PROFILE": "tiny"}
        proc = run_python(
            [sys.executable, str(REPO / "train.py"), "trainer=ddp", "trainer.accelerator=cpu"], tmp_path, env
        )
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(expected), line
    assert not (tmp_path / "logs").exists()  # refused before the run began: no run dir, no rank started in it
