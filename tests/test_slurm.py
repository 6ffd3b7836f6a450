"""SLURM: the submitit launcher config, and requeue on preemption handled by exactly one party."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS
from hydra import compose, initialize_config_dir

from project import build
from project.runs.resume import resume_point

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


def slurm_job(tmp_path: Path, extra_env: dict) -> subprocess.CompletedProcess:
    """One (fake) SLURM job step: train 3 epochs, preempted with SIGUSR1 at epoch 1 unless it resumed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC"))}
    env.update(
        SLURM_ENV,
        PYTHONPATH=str(TESTS),
        PATH=f"{tmp_path / 'bin'}:{env['PATH']}",
        REQUEUE_LOG=str(tmp_path / "requeue.log"),
        **extra_env,
    )
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "trainer.accelerator=cpu",
        "model=mlp",
        "debug=limit",
        "~callbacks.early_stopping",
        "+callbacks.preempt._target_=probes.PreemptionProbe",
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def fake_scontrol(tmp_path):
    """`scontrol requeue <job>` records the call and ends the job, as SLURM would."""
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$REQUEUE_LOG"\nkill -9 $PPID\n')
    scontrol.chmod(0o755)
    return tmp_path / "requeue.log"


@pytest.mark.slow
def test_plain_slurm_job_lightning_requeues_and_the_requeued_job_resumes(tmp_path, fake_scontrol):
    first = slurm_job(tmp_path, {})
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert fake_scontrol.read_text().split() == ["requeue", "99"]
    run = tmp_path / "logs" / "train" / "runs" / "slurm_99_0"  # stable across the requeue
    assert (run / "hpc_ckpt_1.ckpt").is_file()

    second = slurm_job(tmp_path, {"SLURM_RESTART_COUNT": "1"})  # SLURM starts the same job again
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {run / 'hpc_ckpt_1.ckpt'}" in second.stdout + second.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 2
    assert fake_scontrol.read_text().split() == ["requeue", "99"]  # requeued once


@pytest.mark.slow
def test_submitit_job_lightning_stays_out_and_the_resubmitted_job_resumes(tmp_path, fake_scontrol):
    first = slurm_job(tmp_path, {"SUBMITIT_EXECUTOR": "slurm"})
    # no Lightning requeue (submitit's own handler listens on USR2): SIGUSR1 saves at the next step and exits 138
    assert first.returncode == 128 + signal.SIGUSR1, first.stderr[-2000:]
    assert "stopped by SIGUSR1 at epoch 1" in first.stderr
    run = tmp_path / "logs" / "train" / "runs" / "slurm_99_0"
    assert not fake_scontrol.exists() and not list(run.glob("hpc_ckpt_*"))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1  # saved mid-epoch 1

    second = slurm_job(tmp_path, {"SUBMITIT_EXECUTOR": "slurm", "SLURM_RESTART_COUNT": "1"})  # resubmitted
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Resuming from {run / 'checkpoints' / 'last.ckpt'}" in second.stdout + second.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 2
