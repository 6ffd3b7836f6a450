"""A resume that cannot be exact is refused or said, never silent, and one that can is: a plateau scheduler's
skipped step, the best checkpoint across run dirs, gradient accumulation, the loader's position and randomness.
Models and data are a user's own (tests/user_tables.py). Kills and signals in general: tests/test_fault_tolerance.py."""

import json
import signal

import pytest
import torch
from conftest import run_dirs
from test_fault_tolerance import PLATEAU, RUN, assert_same_weights, train, weights

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kill_at", [5, 11], ids=["mid-epoch", "after-the-epoch-end-checkpoint"])
def test_a_plateau_scheduler_resumes_with_the_unbroken_runs_learning_rate(tmp_path, kill_at):
    """Lightning skips a ReduceLROnPlateau's step at the end of the epoch a run resumes in (its metric is not in the
    checkpoint): the resumed run went on at twice the unbroken run's learning rate."""
    train(tmp_path / "unbroken", *PLATEAU)
    killed = train(tmp_path / "killed", *PLATEAU, env={"KILL_AT_STEP": str(kill_at)}, check=False)
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    train(tmp_path / "resumed", *PLATEAU, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    (unbroken,), (resumed,) = run_dirs(tmp_path / "unbroken" / "logs"), run_dirs(tmp_path / "resumed" / "logs")
    lrs = [
        torch.load(r / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"][0]["lr"]
        for r in (unbroken, resumed)
    ]
    assert lrs == [0.01 / 2, 0.01 / 2]  # the first epoch's end sets the best, the second's halves it (the third's
    # step comes after its last.ckpt)
    assert_same_weights(weights(resumed), weights(unbroken))


def test_a_resumed_run_keeps_the_unbroken_runs_best_checkpoint_and_tests_it(tmp_path):
    """A resumed run writes into a new run dir, for which Lightning forgets the best score: its first new epoch became
    the best checkpoint, worse or not, and the test took it (exit 0). Now the best file comes along, by hard link."""
    overfits = [a.replace("PlateauRegressor", "Overfits") for a in PLATEAU if a != "test=false"]
    train(tmp_path / "unbroken", *overfits)
    killed = train(tmp_path / "killed", *overfits, env={"KILL_AT_STEP": "14"}, check=False)
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    best = run / "checkpoints" / "epoch_000.ckpt"
    before = best.stat()
    train(tmp_path / "resumed", *overfits, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    (unbroken,), (resumed,) = run_dirs(tmp_path / "unbroken" / "logs"), run_dirs(tmp_path / "resumed" / "logs")
    assert sorted(p.name for p in (resumed / "checkpoints").glob("epoch_*")) == ["epoch_000.ckpt"]
    assert [json.loads((r / "test_metrics.json").read_text())["test/mse"] for r in (unbroken, resumed)] == [
        json.loads((unbroken / "test_metrics.json").read_text())["test/mse"]
    ] * 2
    after = best.stat()  # the killed run's own file is as it was
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


def test_a_run_accumulating_gradients_killed_between_steps_resumes_bit_for_bit(tmp_path):
    """last.ckpt every 2 optimizer steps of 3 batches each: it was saved again after each batch that only added to
    the gradients (the step count had not moved), so a resume from it lost that batch's gradients."""
    accumulating = [*RUN, "trainer.accumulate_grad_batches=3", "callbacks.last_checkpoint.every_n_steps=2"]
    train(tmp_path / "unbroken", *accumulating)
    killed = train(tmp_path / "killed", *accumulating, env={"KILL_AT_BATCH": "8"}, check=False)  # after the 7th
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    train(tmp_path / "resumed", *accumulating, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    (unbroken,), (resumed,) = run_dirs(tmp_path / "unbroken" / "logs"), run_dirs(tmp_path / "resumed" / "logs")
    assert_same_weights(weights(resumed), weights(unbroken))


def test_resuming_mid_epoch_with_another_batch_size_is_one_line(tmp_path):
    """The loader's position is a count of batches: with another batch size it named other samples, and the resumed
    epoch ran no step at all (exit 0)."""
    train(tmp_path / "killed", *RUN, env={"KILL_AT_STEP": "5"}, check=False)
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    resumed = train(
        tmp_path / "resumed", *RUN, "data.batch_size=16", f"ckpt_path={run}/checkpoints/last.ckpt", check=False
    )
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    (line,) = resumed.stderr.strip().splitlines()
    assert line.startswith("error: the checkpoint was saved after batch 3 of an epoch of "), line
    assert "in batches of 32; this run's loader has" in line and "in batches of 16" in line
    assert run_dirs(tmp_path / "resumed" / "logs") == []


WEIGHTED = [a.replace("DiabetesData", "WeightedDiabetesData") for a in PLATEAU]


def test_a_loader_that_cannot_resume_mid_epoch_says_so_and_another_sampler_is_one_line(tmp_path):
    """A sampler of the user's own (a WeightedRandomSampler) keeps no position: a mid-epoch resume started the epoch's
    order over, silently. A checkpoint that holds a position, resumed with such a loader, was Lightning's traceback."""
    train(tmp_path / "killed", *WEIGHTED, env={"KILL_AT_STEP": "5"}, check=False)
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    resumed = train(tmp_path / "resumed", *WEIGHTED, f"ckpt_path={run}/checkpoints/last.ckpt")
    said = resumed.stdout + resumed.stderr
    assert (
        "Resumed after batch 3 of an epoch, with a training loader that cannot continue there (a sampler of its" in said
    )
    train(tmp_path / "plain", *WEIGHTED, "+data.weighted=false", env={"KILL_AT_STEP": "5"}, check=False)
    (plain,) = run_dirs(tmp_path / "plain" / "logs")
    refused = train(tmp_path / "other", *WEIGHTED, f"ckpt_path={plain}/checkpoints/last.ckpt", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: data: the checkpoint holds its training loader's position mid-epoch"), line
    assert run_dirs(tmp_path / "other" / "logs") == []


def test_a_resume_with_persistent_loader_workers_says_their_draws_start_over(tmp_path):
    """Random draws in workers (augmentation) cannot be given back: said, where it was silent."""
    workers = [*PLATEAU, "+data.num_workers=1"]
    train(tmp_path / "killed", *workers, env={"KILL_AT_STEP": "12"}, check=False)  # after the epoch-end save
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    resumed = train(tmp_path / "resumed", *workers, f"ckpt_path={run}/checkpoints/last.ckpt")
    assert "Resumed with 1 loader workers: random draws inside them" in resumed.stdout + resumed.stderr
