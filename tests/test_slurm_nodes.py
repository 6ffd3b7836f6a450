"""SLURM jobs across nodes for real: `slurm_nodes` (tests/slurm_cluster.py), 2 nodes of 1 CPU on this host, each its
own slurmd. slurm/train.sbatch trains one ddp run across both nodes; slurm/requeue.sbatch survives one node failing
mid-epoch and ends with the weights of the unbroken run, bit for bit."""

import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO, WARM, cli_env, run_dirs
from slurm_cluster import Cluster, slurm_nodes  # noqa: F401  the fixture

# one task of one core on each node, no GPU
ON_CPU = ["--nodes=2", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1"]
# train.py arguments after the script, as in test_slurm.py: gloo on CPU, the tiny profile with 6 steps an epoch
# (2 epochs), fixed seed and deterministic kernels (bit for bit), last.ckpt every step, a stop signal acted on at
# the next step; probes write what each rank saw (ShardProbe) and, with $STEP_SLEEP, slow every step (KillAt)
STEPS_PER_EPOCH = 6
RUN = [
    "trainer.accelerator=cpu",
    "model=mlp",
    "seed=1",
    "trainer.deterministic=true",
    f"trainer.limit_train_batches={STEPS_PER_EPOCH}",
    "test=false",
    "logger=none",
    "callbacks.last_checkpoint.every_n_steps=1",
    "callbacks.run_checks.every_n_steps=1",
    "+callbacks.shards._target_=probes.ShardProbe",
    "+callbacks.pace._target_=probes.KillAt",
]
LAUNCHER_VARS = ("SLURM_", "SBATCH_", "SRUN_", "SUBMITIT_", "TORCHELASTIC", "MASTER_", "NODE_RANK")


@dataclass
class Job:
    id: str
    work: Path
    info: dict[str, str]  # scontrol show job, once it ended
    seconds: float  # from sbatch to its end
    marks: dict[str, Any]  # what the test saw on the way

    @property
    def output(self) -> str:
        return (self.work / "job.out").read_text(errors="replace")

    @property
    def run(self) -> Path:
        (run,) = run_dirs(self.work / "logs")
        return run

    def probes(self) -> list[dict]:
        return [json.loads((self.work / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]


def run_job(
    cluster: Cluster,
    work: Path,
    script: str,
    args: list[str],
    interrupt: Callable[[str], dict[str, Any]] = lambda job_id: {},
    **env: str,
) -> Job:
    """`sbatch <ON_CPU> slurm/<script> <RUN> <args>` from the repository root, as a user's shell submits it (the
    venv's python first on PATH, forked warm: tests/warm.py); `interrupt(job id)` while it runs; it must end
    COMPLETED."""
    (work / "probe").mkdir()
    job_env = cli_env(PROJECT_PROFILE="tiny", PROBE_DIR=str(work / "probe"), **env)
    job_env["PATH"] = os.pathsep.join([str(WARM.python_on_path()), str(Path(sys.executable).parent), job_env["PATH"]])
    job_env = {k: v for k, v in job_env.items() if not k.startswith(LAUNCHER_VARS)}
    started = time.monotonic()
    options = [*ON_CPU, f"--output={work / 'job.out'}"]
    job_id = cluster.sbatch(*options, f"slurm/{script}", *RUN, f"paths.root_dir={work}", *args, cwd=REPO, env=job_env)
    marks = interrupt(job_id)
    info = cluster.wait(job_id, timeout=180, restarts=int(marks.get("restarts", 0)))
    job = Job(job_id, work, info, time.monotonic() - started, marks)
    output = job.output if (work / "job.out").is_file() else ""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{output[-3000:]}"
    return job


def saved_step(path: Path) -> int:
    """The global step of a checkpoint (-1 while there is none)."""
    if not path.is_file():
        return -1
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except (RuntimeError, OSError, EOFError):  # being replaced right now
        return -1


def wait_until(done: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.1)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def unbroken_job(slurm_nodes: Cluster, tmp_path_factory) -> Job:  # noqa: F811
    """slurm/train.sbatch across both nodes, never interrupted."""
    return run_job(slurm_nodes, tmp_path_factory.mktemp("unbroken"), "train.sbatch", [])


@pytest.mark.slow
def test_one_ddp_run_across_two_nodes(unbroken_job: Job, slurm_nodes: Cluster):  # noqa: F811
    run = unbroken_job.run  # the only run dir, both nodes' ranks', named by the job
    assert run.name == f"slurm_{unbroken_job.id}_0"
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert (config["trainer"]["num_nodes"], config["trainer"]["devices"]) == (2, 1)  # from $SLURM_NNODES
    seen = unbroken_job.probes()
    assert [(r["rank"], r["node_rank"], r["world_size"]) for r in seen] == [(0, 0, 2), (1, 1, 2)]
    assert {r["environment"] for r in seen} == {"SLURMEnvironment"}
    assert not set(seen[0]["seen"]["0"]) & set(seen[1]["seen"]["0"])  # each rank its own shard of the data
    assert unbroken_job.info["NodeList"] == "127.0.0.[1-2]" and unbroken_job.info["NumNodes"] == "2"
    # each rank its own log (they were interleaved in train.log), one set of checkpoints
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log", "train_ddp_process_1.log"]
    assert "Node 0, rank 0: waiting for 2 processes on 2 nodes at 127.0.0.1:" in (run / "train.log").read_text()
    assert "Node 1, rank 1: waiting for 2 processes" in (run / "train_ddp_process_1.log").read_text()
    assert "rank 1" not in (run / "train.log").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_001.ckpt", "last.ckpt"]
    assert saved_step(run / "checkpoints" / "last.ckpt") == 2 * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def node_failed_job(slurm_nodes: Cluster, tmp_path_factory) -> Job:  # noqa: F811
    """slurm/requeue.sbatch with the same run; once it saved its first step, its second node goes down (`scontrol
    update state=down`, as SLURM marks a node that stopped answering): SLURM requeues the job and stops its tasks;
    the job waits for two nodes until the node is back (`state=resume`), then continues. Every step sleeps 0.3 s
    (probes.KillAt): time for the failure to land mid-epoch."""
    work = tmp_path_factory.mktemp("node_failed")
    node = slurm_nodes.nodes[1]

    def interrupt(job_id: str) -> dict[str, Any]:
        last = work / "logs" / "train" / "runs" / f"slurm_{job_id}_0" / "checkpoints" / "last.ckpt"
        wait_until(lambda: saved_step(last) >= 1, "the job's first checkpoint")
        slurm_nodes.scontrol("update", f"nodename={node}", "state=down", "reason=test")
        stopped = re.compile(r"^stopped by SIGTERM at epoch \d+, step (\d+)", re.M)
        wait_until(lambda: stopped.search((work / "job.out").read_text()) is not None, "the tasks' stop")
        slurm_nodes.wait(job_id, timeout=60, until={"PENDING"}, restarts=1)
        # requeued, and once eligible again (cred_expire, 5 s) it waits for the node: it needs two
        wait_until(lambda: slurm_nodes.job(job_id).get("Reason", "").startswith("Nodes_required"), "its wait for nodes")
        states = slurm_nodes.node_states()
        slurm_nodes.scontrol("update", f"nodename={node}", "state=resume")
        (at,) = stopped.findall((work / "job.out").read_text())  # once: the job stopped once
        return {"stopped_at": int(at), "restarts": 1, "states": states}

    return run_job(slurm_nodes, work, "requeue.sbatch", [], interrupt, STEP_SLEEP="0.3")


@pytest.mark.slow
def test_a_node_failing_mid_epoch_requeues_the_job_which_ends_bit_for_bit(node_failed_job: Job, unbroken_job: Job):
    job, run = node_failed_job, node_failed_job.run
    at = job.marks["stopped_at"]
    assert 0 < at < STEPS_PER_EPOCH, f"stopped at step {at}, not mid-epoch 0"
    assert job.marks["states"] == {"127.0.0.1": "idle", "127.0.0.2": "down"}  # while the job waited
    assert int(job.info["Restarts"]) == 1
    out = job.output
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert stopped[0].startswith(f"stopped by SIGTERM at epoch 0, step {at}: saved {run}/checkpoints/last.ckpt")
    assert out.count(f"Resuming from {run}/checkpoints/last.ckpt") == 2, out[-3000:]  # each rank, the same one
    got, want = weights(run), weights(unbroken_job.run)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "the requeued job ended with other weights"


@pytest.mark.slow
def test_fsdp_across_two_nodes(slurm_nodes: Cluster, tmp_path):  # noqa: F811
    """trainer.strategy=fsdp (FSDP2, gloo on CPU) on slurm/train.sbatch's srun tasks: each node's rank holds half of
    every parameter, and both write their shards of the checkpoints into the one run dir."""
    job = run_job(slurm_nodes, tmp_path, "train.sbatch", ["trainer.strategy=fsdp"])
    seen = job.probes()
    assert [(r["rank"], r["node_rank"], r["world_size"]) for r in seen] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["local_params"] < 0.6 * r["params"] for r in seen)  # sharded
    last = job.run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["global_step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.slow
def test_the_pipeline_across_two_nodes_takes_one_devices_steps(slurm_nodes: Cluster, tmp_path):  # noqa: F811
    """trainer=pipeline on slurm/train.sbatch's srun tasks: the MLP cut into two stages, one on each node, ends with
    the weights of the same run on one device (one process, no SLURM) within float tolerance."""
    pipeline = ["trainer=pipeline", "trainer.strategy.micro_batches=2", "model.net.dropout=0.0"]  # no stage RNG
    (tmp_path / "job").mkdir()
    job = run_job(slurm_nodes, tmp_path / "job", "train.sbatch", pipeline)
    config = yaml.safe_load((job.run / ".hydra" / "config.yaml").read_text())["trainer"]
    assert config["strategy"]["_target_"] == "engine.strategies.pipeline.PipelineStrategy"
    assert (config["num_nodes"], config["devices"]) == (2, 1)  # one stage on each node
    one = tmp_path / "one"
    (one / "probe").mkdir(parents=True)
    from conftest import run_python

    env = cli_env(PROJECT_PROFILE="tiny", PROBE_DIR=str(one / "probe"))
    env = {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARS)}
    alone = [arg for arg in RUN if "ShardProbe" not in arg]  # it reads a distributed strategy's environment
    argv = [sys.executable, str(REPO / "train.py"), *alone, "model.net.dropout=0.0", f"paths.root_dir={one}"]
    proc = run_python(argv, REPO, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (single,) = run_dirs(one / "logs")
    got, want = weights(job.run), weights(single)
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst < 1e-5, f"the pipeline across nodes is {worst} off one device"
    print(f"pipeline across 2 nodes: {job.seconds:.1f} s, {worst:.1e} off one device")


@pytest.mark.slow
def test_a_submitit_sweep_whose_jobs_take_two_nodes_each(slurm_nodes: Cluster, cli, tmp_path):  # noqa: F811
    """hydra/launcher=slurm with trainer.num_nodes=2: submitit asks SLURM for 2 nodes per sweep job, and each job's
    ddp run spans both (a rank on each), in its own job dir of the sweep."""
    conf = slurm_nodes.env()["SLURM_CONF"]
    proc = cli(
        "train.py", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1", "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2",
        "trainer.accelerator=cpu", "model=mlp", "logger=none", "test=false", "seed=1,2",
        env={"PROJECT_PROFILE": "tiny", "SLURM_CONF": conf},
    )  # fmt: skip
    assert "error:" not in proc.stderr, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(jobs) == 2
    for job in jobs:
        info = slurm_nodes.wait(job.name)
        assert (info["JobState"], info["NumNodes"], info["NodeList"]) == ("COMPLETED", "2", "127.0.0.[1-2]")
    for num in ("0", "1"):
        assert json.loads((sweep / num / "fit_metrics.json").read_text())["status"] == "ok"
        config = yaml.safe_load((sweep / num / ".hydra" / "config.yaml").read_text())["trainer"]
        assert (config["num_nodes"], config["devices"]) == (2, 1)
        assert sorted(p.name for p in (sweep / num).glob("*.log")) == ["train.log", "train_ddp_process_1.log"]


@pytest.mark.slow
def test_a_node_failing_while_the_job_starts_requeues_it_and_it_ends_bit_for_bit(
    slurm_nodes: Cluster,  # noqa: F811
    tmp_path_factory,
    unbroken_job: Job,
):
    """The second node goes down as soon as the job runs, before any checkpoint (its tasks still importing, or
    meeting at the rendezvous): the requeued job starts over in the run dir the first start claimed, and ends with
    the unbroken job's weights."""
    work = tmp_path_factory.mktemp("failed_starting")
    node = slurm_nodes.nodes[1]

    def interrupt(job_id: str) -> dict[str, Any]:
        wait_until(lambda: slurm_nodes.job(job_id).get("JobState") == "RUNNING", "the job's start", timeout=60)
        slurm_nodes.scontrol("update", f"nodename={node}", "state=down", "reason=test")
        slurm_nodes.wait(job_id, timeout=60, until={"PENDING"}, restarts=1)
        last = work / "logs" / "train" / "runs" / f"slurm_{job_id}_0" / "checkpoints" / "last.ckpt"
        saved = saved_step(last)
        slurm_nodes.scontrol("update", f"nodename={node}", "state=resume")
        return {"restarts": 1, "saved_before": saved}

    job = run_job(slurm_nodes, work, "requeue.sbatch", [], interrupt)
    assert int(job.info["Restarts"]) == 1 and job.marks["saved_before"] == -1  # it failed before any checkpoint
    assert "already holds checkpoints" not in job.output and "Resuming from" not in job.output
    got, want = weights(job.run), weights(unbroken_job.run)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "the requeued job ended with other weights"
