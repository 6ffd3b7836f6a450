"""SLURM: the submitit launcher config, and requeue on preemption handled by exactly one party."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS, WARM, cli_env, dead_pid, run_dirs, run_python
from hydra import compose, initialize_config_dir
from slurm_cluster import Cluster

from engine import build
from engine.runs import atomic_io
from engine.runs.resume import resume_point

SLURM_ENV = {
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_ID": "99",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NAME": "train",
    "SLURM_NODELIST": "localhost",
}


def test_slurm_launcher_asks_for_one_task_per_device_on_each_node():
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.nodes, launcher.gpus_per_node) == (4, 2, 4)


@pytest.mark.parametrize(("submitit", "lightning_requeues"), [(False, True), (True, False)])
def test_only_one_party_requeues(make_cfg, monkeypatch, submitit, lightning_requeues):
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if submitit:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    else:
        monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    cfg = make_cfg("trainer.accelerator=cpu")
    # where Lightning's signal connector looks when it decides whether to install its SIGUSR1 handler
    environment = build.trainer(cfg.trainer, [], [])._accelerator_connector.cluster_environment
    assert type(environment).__name__ == "SLURMEnvironment"
    assert environment.auto_requeue is lightning_requeues


def test_only_a_restarted_job_resumes_from_its_own_dir(tmp_path):
    assert resume_point(tmp_path, restarted=False, ckpt_path=None) is None
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) is None  # restarted before any checkpoint
    assert resume_point(tmp_path, restarted=True, ckpt_path="start.ckpt") == "start.ckpt"
    (tmp_path / "checkpoints").mkdir()
    torch.save({"epoch": 1}, tmp_path / "checkpoints" / "epoch_001.ckpt")
    torch.save({"epoch": 2}, tmp_path / "checkpoints" / "last.ckpt")
    last = str(tmp_path / "checkpoints" / "last.ckpt")
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) == last
    # started with ckpt_path=X and requeued: its own progress wins, or every requeue would start over from X
    assert resume_point(tmp_path, restarted=True, ckpt_path="start.ckpt") == last
    assert resume_point(tmp_path, restarted=False, ckpt_path="start.ckpt") == "start.ckpt"
    # the job was killed while writing last.ckpt: continue from the newest readable one
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 torn")
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) == str(tmp_path / "checkpoints" / "epoch_001.ckpt")
    torch.save({"epoch": 3}, tmp_path / "hpc_ckpt_1.ckpt")  # Lightning's requeue checkpoint, the newest
    assert resume_point(tmp_path, restarted=True, ckpt_path="start.ckpt") == str(tmp_path / "hpc_ckpt_1.ckpt")


def test_a_restarted_job_resumes_from_its_furthest_checkpoint_whatever_the_files_times(tmp_path, caplog):
    """`cp -r` of a run folder (to scratch, off a cluster) gives its files new modification times in any order: a
    requeued job took the most recently modified file and resumed from an older epoch_* file, losing the steps
    since. The checkpoints' own global step decides; at the same step last.ckpt, saved after the best file."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 23, "epoch": 0}, folder / "epoch_000.ckpt")
    torch.save({"global_step": 100, "epoch": 3}, folder / "last.ckpt")
    os.utime(folder / "epoch_000.ckpt", (time.time() + 60, time.time() + 60))  # copied last
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) == str(folder / "last.ckpt")
    torch.save({"global_step": 100, "epoch": 3}, folder / "epoch_003.ckpt")
    os.utime(folder / "epoch_003.ckpt", (time.time() + 120, time.time() + 120))
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) == str(folder / "last.ckpt")
    torch.save({"global_step": 130, "epoch": 4}, tmp_path / "hpc_ckpt_1.ckpt")  # Lightning's requeue save, furthest
    os.utime(tmp_path / "hpc_ckpt_1.ckpt", (time.time() - 600, time.time() - 600))
    assert resume_point(tmp_path, restarted=True, ckpt_path=None) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"PK\x03\x04 torn")  # cut off: the furthest whole one, and why
    with caplog.at_level("WARNING", logger="engine.runs.resume"):
        assert resume_point(tmp_path, restarted=True, ckpt_path=None) == str(folder / "last.ckpt")
    assert f"Not resuming from {tmp_path / 'hpc_ckpt_1.ckpt'}: it cannot be loaded (" in caplog.text
    # the hidden files of saves the stop cut off (Lightning's requeue save too, beside the checkpoints folder) go
    name = f".hpc_ckpt_2.ckpt.partial-{atomic_io._HOST}-{dead_pid()}"
    left = [tmp_path / name, folder / name.replace("hpc_ckpt_2", "last")]
    for path in left:
        path.write_bytes(b"cut off")
    resume_point(tmp_path, restarted=True, ckpt_path=None)
    assert not [path for path in left if path.exists()]


@pytest.mark.slow
def test_submitit_job_lightning_stays_out_and_the_resubmitted_job_resumes(tmp_path):
    """A submitit job step as SLURM's and submitit's variables describe it, run here: SIGUSR1 at epoch 1 (sent by
    the probe) is ours, not Lightning's requeue signal (submitit's own handler listens on USR2)."""

    def job(extra_env: dict) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC"))}
        env.update(SLURM_ENV, SUBMITIT_EXECUTOR="slurm", PYTHONPATH=str(TESTS), **extra_env)
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            "trainer.accelerator=cpu",
            "model=mlp",
            "debug=limit",
            "~callbacks.early_stopping",
            "+callbacks.preempt._target_=probes.PreemptionProbe",
        ]
        return run_python(cmd, tmp_path, env, timeout=300)

    first = job({})
    # no Lightning requeue: SIGUSR1 saves at the next step and exits 138
    assert first.returncode == 128 + signal.SIGUSR1, first.stderr[-2000:]
    assert "stopped by SIGUSR1 at epoch 1" in first.stderr
    run = tmp_path / "logs" / "train" / "runs" / "slurm_99_0"
    assert not list(run.glob("hpc_ckpt_*"))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1  # saved mid-epoch 1

    second = job({"SLURM_RESTART_COUNT": "1"})  # resubmitted
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Resuming from {run / 'checkpoints' / 'last.ckpt'}" in second.stdout + second.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 2


# ---------------------------------------------------------------- on a real cluster (tests/slurm_cluster.py)

# Both batch scripts of slurm/ as a user submits them, on CPU: two tasks of one core each, no GPU.
ON_CPU = ["--gres=none", "--ntasks-per-node=2", "--cpus-per-task=1"]
# train.py arguments after the script: gloo on CPU, the tiny profile (PROJECT_PROFILE) with 6 steps an epoch
# (2 epochs), fixed seed and deterministic kernels (bit for bit), last.ckpt every step; probes write what each rank
# saw (ShardProbe) and, with $STEP_SLEEP, slow every step (KillAt)
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
    "callbacks.run_checks.every_n_steps=1",  # a signal stops the ranks at the next step
    "+callbacks.shards._target_=probes.ShardProbe",
    "+callbacks.pace._target_=probes.KillAt",
]
LAUNCHER_VARS = ("SLURM_", "SBATCH_", "SRUN_", "SUBMITIT_", "TORCHELASTIC")


def job_env(**extra: str) -> dict[str, str]:
    """What a user's shell exports to sbatch: the venv's python first on PATH, tests/ importable (probes), the
    test profile; no variables of a SLURM job or launcher the tests themselves may run in. The `python` the job's
    srun tasks start is the venv's, forked warm (tests/warm.py): SLURM starts, signals and requeues the tasks as
    ever, they skip the imports."""
    env = cli_env(PROJECT_PROFILE="tiny", **extra)
    env["PATH"] = os.pathsep.join([str(WARM.python_on_path()), str(Path(sys.executable).parent), env["PATH"]])
    return {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARS) or k == "SLURM_CONF"}


def submit(cluster: Cluster, work: Path, script: str, env: dict[str, str]) -> str:
    """`sbatch <options> slurm/<script> <train.py arguments>` from the repository root, as the README has it; the
    run writes under `work` (paths.root_dir), the job's output goes to work/job.out."""
    options = [*ON_CPU, f"--output={work / 'job.out'}"]
    return cluster.sbatch(*options, f"slurm/{script}", *RUN, f"paths.root_dir={work}", cwd=REPO, env=env)


def saved_step(path: Path) -> int:
    """The global step of a checkpoint (-1 while there is none)."""
    if not path.is_file():
        return -1
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def wait_until(done: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.1)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@dataclass
class Job:
    id: str
    work: Path
    info: dict[str, str]  # scontrol show job, once it ended
    seconds: float  # from sbatch to its end
    marks: dict[str, int]  # what the test saw on the way (steps)

    @property
    def output(self) -> str:
        return (self.work / "job.out").read_text(errors="replace")

    @property
    def run(self) -> Path:
        (run,) = run_dirs(self.work / "logs")
        return run


def run_job(cluster: Cluster, work: Path, script: str, interrupt: Callable[[str], dict[str, int]], **env: str) -> Job:
    """Submit, `interrupt(job id)` while it runs, wait until it ended; it must have completed."""
    (work / "probe").mkdir()
    started = time.monotonic()
    job_id = submit(cluster, work, script, job_env(PROBE_DIR=str(work / "probe"), **env))
    marks = interrupt(job_id)
    info = cluster.wait(job_id, timeout=180, restarts=marks.get("restarts", 0))
    job = Job(job_id, work, info, time.monotonic() - started, marks)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{job.output[-3000:]}"
    return job


@pytest.fixture(scope="module")
def unbroken_job(slurm_cluster: Cluster, tmp_path_factory) -> Job:
    """slurm/train.sbatch: one ddp run on 2 srun tasks, never interrupted."""
    return run_job(slurm_cluster, tmp_path_factory.mktemp("unbroken"), "train.sbatch", lambda job_id: {})


@pytest.fixture(scope="module")
def interrupted_job(slurm_cluster: Cluster, tmp_path_factory) -> Job:
    """slurm/requeue.sbatch with the same run, interrupted twice. Requeued by SLURM (`scontrol requeue`) once it
    saved its first step; once the restarted job has trained two steps of its own, sent SIGUSR1 (what
    --signal=USR1@90 sends 90 s before the time limit), on which Lightning saves hpc_ckpt_1.ckpt and requeues it
    again. Every step sleeps 0.3 s (probes.KillAt): time for each interruption to land mid-epoch."""
    work = tmp_path_factory.mktemp("interrupted")

    def interrupt(job_id: str) -> dict[str, int]:
        last = work / "logs" / "train" / "runs" / f"slurm_{job_id}_0" / "checkpoints" / "last.ckpt"
        wait_until(lambda: saved_step(last) >= 1, "the job's first checkpoint")
        slurm_cluster.scontrol("requeue", job_id)
        # SIGTERM to the tasks: they save at the next step they agree on, and rank 0 says where
        stopped = re.compile(r"^stopped by SIGTERM at epoch \d+, step (\d+)", re.M)
        wait_until(lambda: stopped.search((work / "job.out").read_text()) is not None, "the tasks' stop")
        requeued_at = int(stopped.search((work / "job.out").read_text())[1])  # type: ignore[index]
        wait_until(lambda: saved_step(last) >= requeued_at + 2, "two steps of the restarted job")
        slurm_cluster.scancel("--signal=USR1", job_id)
        return {"requeued_at": requeued_at, "restarts": 2}

    return run_job(slurm_cluster, work, "requeue.sbatch", interrupt, STEP_SLEEP="0.3")


@pytest.mark.slow
def test_srun_tasks_are_the_ranks_of_one_run(unbroken_job: Job):
    probe = unbroken_job.work / "probe"
    seen = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(probe.glob("rank*")) == [probe / "rank0.json", probe / "rank1.json"]  # no third process
    assert [(r["rank"], r["world_size"]) for r in seen] == [(0, 2), (1, 2)]
    assert {r["environment"] for r in seen} == {"SLURMEnvironment"}  # ranks from SLURM's variables, not launched
    assert not set(seen[0]["seen"]["0"]) & set(seen[1]["seen"]["0"])  # each rank its own shard of the data
    run = unbroken_job.run  # the only run dir: both tasks', rank 0 writes it
    assert run.name == f"slurm_{unbroken_job.id}_0" and (run / "checkpoints" / "last.ckpt").is_file()
    # no process Lightning launched itself: rank 1 is srun's, logging into its own file
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log", "train_ddp_process_1.log"]
    assert "srun` command is available" not in unbroken_job.output


@pytest.mark.slow
def test_a_job_requeued_mid_epoch_resumes_its_own_checkpoint_bit_for_bit(interrupted_job: Job, unbroken_job: Job):
    out, run, at = interrupted_job.output, interrupted_job.run, interrupted_job.marks["requeued_at"]
    assert 0 < at < STEPS_PER_EPOCH, f"requeued at step {at}, not mid-epoch 0"
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert stopped[0].startswith(f"stopped by SIGTERM at epoch 0, step {at}: saved {run}/checkpoints/last.ckpt")
    # each restart continues from its own run dir's newest checkpoint (each rank says so)
    assert out.count(f"Resuming from {run}/") == 4, out[-3000:]
    got, want = weights(run), weights(unbroken_job.run)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "the requeued job ended with other weights"


@pytest.mark.slow
def test_the_signal_before_the_time_limit_checkpoints_and_requeues(interrupted_job: Job):
    out, run, job_id = interrupted_job.output, interrupted_job.run, interrupted_job.id
    assert "Handling auto-requeue signal: 10" in out and f"Requeued SLURM job: {job_id}" in out  # on SIGUSR1
    hpc = saved_step(run / "hpc_ckpt_1.ckpt")
    assert interrupted_job.marks["requeued_at"] + 2 <= hpc < 2 * STEPS_PER_EPOCH  # saved mid-run
    assert int(interrupted_job.info["Restarts"]) == 2
    # the third start continued from the newest checkpoint: hpc_ckpt_1.ckpt, or last.ckpt when the ranks saved
    # it on the requeue's SIGTERM after that
    (resumed,) = [line for line in out.splitlines() if "Restoring states from" in line][-1:]
    assert resumed.endswith((f"{run}/hpc_ckpt_1.ckpt", f"{run}/checkpoints/last.ckpt")), resumed


@pytest.mark.slow
def test_a_sweep_on_slurm_runs_its_ddp_jobs_on_the_cluster_and_records_a_failed_one(
    slurm_cluster: Cluster, cli, tmp_path
):
    """hydra/launcher=slurm (submitit): one SLURM job per sweep job, each 2 srun tasks (trainer.devices) of ddp on
    CPU; the second fails (its seed, refused before it imports torch: the cheapest failure), is recorded as failed,
    and the sweep still writes its summary."""
    proc = cli(
        "train.py",
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.gpus_per_node=0",  # on CPU; the cluster's node has its cores and memory, no GPU
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "model=mlp",
        "logger=none",
        "test=false",
        "seed=1,-1",
        env={"PROJECT_PROFILE": "tiny"},
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and errors[0].startswith("error: sweep job 1: seed=-1: a seed is"), proc.stderr[-3000:]
    assert errors[1].startswith("error: 1 of 2 sweep jobs failed")
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    # one SLURM job per sweep job (submitit: the tasks of one job array, <array job id>_<task id>)
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(jobs) == 2
    for job in jobs:
        assert slurm_cluster.wait(job.name)["JobState"] == "COMPLETED"  # the job ran; its run may have failed
        assert sorted(p.name for p in job.glob("*_log.out")) == [f"{job.name}_0_log.out", f"{job.name}_1_log.out"]
    assert json.loads((sweep / "0" / "fit_metrics.json").read_text())["status"] == "ok"
    assert (sweep / "1" / "error.txt").read_text().startswith("seed=-1: a seed is an integer")
    with open(sweep / "summary.csv") as f:
        rows = {row["job"]: row for row in csv.DictReader(f)}
    assert (rows["0"]["status"], rows["1"]["status"]) == ("ok", "failed")


def test_a_job_sbatch_refuses_is_one_line_naming_the_launcher_settings(tmp_path):
    """The launcher's default mem_gb: 64 on a smaller node: submitit raised sbatch's refusal in a traceback, and
    the sweep dir stayed, holding .submitit/ alone."""
    from submitit.core.utils import FailedJobError

    from engine.entry import _sbatch_refused
    from engine.runs import dirs

    refusal = FailedJobError(
        "Could not make sbatch call.\nsbatch: error: Memory specification can not be satisfied\n"
        "sbatch: error: Batch job submission failed: Requested node configuration is not available"
    )
    said = str(_sbatch_refused(refusal))
    assert said.startswith("hydra/launcher=slurm: sbatch refused the job (Memory specification can not be satisfied)")
    assert "hydra.launcher.mem_gb" in said and _sbatch_refused(RuntimeError("sbatch: error: x")) is None
    sweep = tmp_path / "multiruns" / "now"
    (sweep / ".submitit" / "1").mkdir(parents=True)
    (sweep / ".submitit" / "1" / "submission.sh").write_text("#!/bin/bash")
    (sweep / "multirun.yaml").write_text("hydra: {}")
    dirs.CREATED.add(str(sweep.resolve()))
    dirs.remove_if_unused(sweep)
    assert not sweep.exists()
