"""A user's own DataModule, written the plain way (tests/user_tables.py: `DataLoader(dataset, batch_size,
shuffle=...)`), gets what the template's data gets (engine.callbacks.resumable_data): a run killed mid-epoch resumes
bit for bit, shuffle=false holds under ddp, and ddp with half the batch per process takes one device's steps."""

import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python

pytestmark = pytest.mark.slow

TABLE = [
    "~model",
    "+model._target_=user_tables.Regressor",
    "+model.dropout=0.1",  # random state matters
    "~data",
    "+data._target_=user_tables.DiabetesData",
    "monitor.metric=val/mse",
    "monitor.mode=min",
    "trainer.accelerator=cpu",
    "logger=none",
    "test=false",
    "print_config=false",
    "seed=3",
]
# 342 training rows: batches of 32 (10 of them, then 22) per epoch, 2 epochs; last.ckpt every 3 steps
RUN = [
    *TABLE,
    "trainer.max_epochs=2",
    "callbacks.last_checkpoint.every_n_steps=3",
    "+callbacks.kill._target_=probes.KillAt",
]


def train(cwd: Path, *args: str, env: dict | None = None, check: bool = True):
    cwd.mkdir(parents=True, exist_ok=True)
    proc = run_python([sys.executable, str(REPO / "train.py"), *args], cwd, cli_env(**(env or {})))
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_weights(cwd: Path) -> dict[str, torch.Tensor]:
    (run,) = run_dirs(cwd / "logs")
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def test_a_plain_dataloader_resumes_mid_epoch_bit_for_bit(tmp_path):
    train(tmp_path / "unbroken", *RUN)
    killed = train(tmp_path / "killed", *RUN, env={"KILL_AT_STEP": "14"}, check=False)  # epoch 1, step 3 of 11
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 12  # mid-epoch
    resumed = train(tmp_path / "resumed", *RUN, f"ckpt_path={last}")
    assert "not resumable" not in resumed.stdout + resumed.stderr
    want, got = last_weights(tmp_path / "unbroken"), last_weights(tmp_path / "resumed")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("shuffle", ["true", "false"])
def test_ddp_with_half_the_batch_per_process_takes_one_devices_steps(tmp_path, shuffle):
    """One seeded order cut into two shards: each step's two half batches are one device's batch. shuffle=false
    stays unshuffled under ddp (Lightning's own sampler would shuffle)."""
    table = [o for o in TABLE if o != "+model.dropout=0.1"] + [f"+data.shuffle={shuffle}", "trainer.max_epochs=2"]
    train(tmp_path / "one", *table, "+data.batch_size=32")
    ddp = train(tmp_path / "ddp", *table, "+data.batch_size=16", "trainer=ddp", "trainer.accelerator=cpu")
    # its self.log("val/mse", ...) has no sync_dist=True: rank 0's shard alone, which Lightning's warning says
    assert "It is recommended to use `self.log('val/mse', ..., sync_dist=True)`" in ddp.stderr
    want, got = last_weights(tmp_path / "one"), last_weights(tmp_path / "ddp")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0)


def test_a_monitored_metric_that_stops_being_logged_is_refused_not_reused(tmp_path):
    """It logged val/mse in epoch 0 only: later epochs judged the run on epoch 0's value, and the best stayed there."""
    table = [o.replace("user_tables.Regressor", "user_tables.LogsOnce") for o in TABLE]
    proc = train(tmp_path, *table, "trainer.max_epochs=3", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: LogsOnce logged val/mse in the validation of epoch 0 but not in epoch 1's: monitor.metric would judge "
        "the run on a stale value; log it at every validation, or monitor another metric (monitor.metric)"
    )


def test_a_batch_sampler_lightning_cannot_shard_is_one_line_under_ddp(tmp_path):
    """A bucketing batch sampler of the user's own (not torch's BatchSampler) under ddp: Lightning's TypeError came
    with both ranks' tracebacks, exit 1, and the run dir stayed (a blind hostile try). One line, in conf's words."""
    table = [o.replace("user_tables.DiabetesData", "user_tables.BucketedDiabetesData") for o in TABLE]
    proc = train(tmp_path, *table, "trainer=ddp", "trainer.max_epochs=1", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: data: under several processes, Lightning can't inject a (distributed) sampler")
    assert "set `trainer.use_distributed_sampler=false`" in line
    assert not run_dirs(tmp_path / "logs")
