"""Hydra multirun (-m) sweeps, with DDP inside each job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS, run_python

pytestmark = pytest.mark.slow

DDP_JOB = [
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "model=mlp",
    "debug=limit",
    "+callbacks.probe._target_=probes.ShardProbe",
    "+callbacks.probe.per_seed=true",
]


def sweep(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    cmd = [sys.executable, str(REPO / "train.py"), "-m", *overrides]
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), "PROBE_DIR": str(probe), **(env or {})}
    # timeout: a hang (a rank waiting forever for a dead peer) fails the test instead of the CI job
    return run_python(cmd, tmp_path, full_env, timeout=400)


def sweep_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "logs" / "train" / "multiruns").glob("*"))


def first_epoch_order(seed: int, rank: int, samples: int) -> list[str]:
    """The fingerprints of the first `samples` training digits rank `rank` of 2 sees in epoch 0 with `seed`."""
    from probes import fingerprint
    from torch.utils.data import DistributedSampler

    from project.data.digits import DigitsDataModule

    dm = DigitsDataModule()
    dm.setup("fit")
    train = dm.splits["train"]
    sampler = DistributedSampler(train, num_replicas=2, rank=rank, shuffle=True, seed=seed)
    return [fingerprint(train.images[i]) for i in list(sampler)[:samples]]


def test_ddp_sweep_runs_each_jobs_config_on_all_its_ranks_and_goes_on_after_a_crashed_rank(tmp_path):
    proc = sweep(tmp_path, *DDP_JOB, "seed=2,1,null", env={"PROBE_FAIL_SEED": "2"})  # job 0: its rank 1 crashes
    assert proc.returncode == 2
    assert "error: sweep job 0 (" in proc.stderr and "seed=2" in proc.stderr
    (root,) = sweep_dirs(tmp_path)  # one sweep dir: no rank re-ran the sweep on its own
    assert not (root / "0" / "test_metrics.json").exists()
    assert (root / "0" / ".hydra" / "overrides.yaml").is_file()  # the failed job stays inspectable
    for num, seed in (("1", 1), ("2", None)):  # the jobs after it ran to their end, each its own config
        job = root / num
        assert (job / "checkpoints" / "last.ckpt").is_file() and (job / "test_metrics.json").is_file()
        assert json.loads((job / "fit_metrics.json").read_text())["val/acc"] > 0
        ranks = [json.loads((tmp_path / "probe" / f"seed{seed}_rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["seed"] for r in ranks] == [seed, seed] and [r["world_size"] for r in ranks] == [2, 2]
        assert not set(ranks[0]["seen"]["0"]) & set(ranks[1]["seen"]["0"])  # one permutation, split in two
        # seed=null is unseeded on every rank: nothing of the seed=1 job reaches it through the environment
        assert [r["pl_global_seed"] for r in ranks] == ([str(seed)] * 2 if seed is not None else [None, None])
    unseeded = json.loads((tmp_path / "probe" / "seedNone_rank0.json").read_text())["seen"]["0"]
    for seed in (0, 1):  # not the order of a fallback seed, nor the previous job's
        assert unseeded != first_epoch_order(seed, rank=0, samples=len(unseeded))
    seeded = json.loads((tmp_path / "probe" / "seed1_rank0.json").read_text())["seen"]["0"]
    assert seeded == first_epoch_order(1, rank=0, samples=len(seeded))  # the order really is the seed's


def test_every_failed_job_is_one_line_and_the_sweep_goes_on(tmp_path):
    env = {"PROJECT_PROFILE": "tiny"}
    proc = sweep(tmp_path, "model=mlp", "model.optimizer.lr=-1,0.01,-2", env=env)
    assert proc.returncode == 2
    (root,) = sweep_dirs(tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Error executing job" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert sum("Invalid learning rate: -1" in line for line in errors) == 2  # as each job fails
    assert errors[-1] == f"error: 2 of 3 sweep jobs failed; see {root}/<job>/error.txt"
    assert (root / "1" / "test_metrics.json").is_file()  # the good job between them ran to its end
    for job in ("0", "2"):
        text = (root / job / "error.txt").read_text()
        assert text.startswith("model.optimizer: ValueError: Invalid learning rate") and "Traceback" in text
