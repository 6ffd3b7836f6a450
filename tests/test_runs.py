"""Run directories: unique names, names shared by a launch, SLURM batch scripts, and seeding between jobs."""

import os
import random
from pathlib import Path

import pytest
import torch

from engine.runs.dirs import run_dir, unique_dir
from engine.tasks.seeding import seed_run


def test_unique_dir_never_hands_out_the_same_dir_twice(tmp_path: Path):
    base = str(tmp_path / "runs" / "2026-01-01_00-00-00")
    first, second, third = unique_dir(base), unique_dir(base), unique_dir(base)
    assert len({first, second, third}) == 3
    assert all(Path(p).is_dir() for p in (first, second, third))


@pytest.fixture
def slurm_batch(monkeypatch):
    """This process as `python train.py` run by an sbatch script directly (no srun step)."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", "train.sbatch")
    return monkeypatch


def test_runs_of_one_batch_script_get_their_own_dirs_and_find_them_after_a_requeue(tmp_path, slurm_batch):
    parent = str(tmp_path / "runs")
    first, second = run_dir(parent), run_dir(parent)
    assert [Path(p).name for p in (first, second)] == ["slurm_77_run0", "slurm_77_run1"]
    slurm_batch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: the script starts its runs again, in order
    assert [run_dir(parent), run_dir(parent)] == [first, second]


def test_srun_tasks_share_the_steps_dir(tmp_path, slurm_batch):
    slurm_batch.setenv("SLURM_STEP_ID", "3")
    assert Path(run_dir(str(tmp_path))).name == Path(run_dir(str(tmp_path))).name == "slurm_77_3"


def test_seed_null_after_a_seeded_job_is_unseeded():
    draws = []
    for _ in range(2):
        seed_run(1)  # a seeded sweep job ran before in this process
        assert os.environ["PL_GLOBAL_SEED"] == "1"
        seed_run(None)
        assert "PL_GLOBAL_SEED" not in os.environ  # no rank or later process inherits seed 1
        draws.append((torch.rand(3).tolist(), random.random()))
    assert draws[0] != draws[1]


def test_a_resumed_run_reads_its_checkpoint_once(make_cfg, tmp_path, monkeypatch):
    """One CRC pass and one load, for every check before the run and for Lightning's restore."""
    import zipfile

    from project.tasks import train

    first = make_cfg("model=mlp", "profile=tiny", "trainer.max_epochs=1", "logger=none")
    train(first)
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    moved = tmp_path / "last.ckpt"
    last.rename(moved)  # the resumed run writes into the same out/, which must hold no checkpoints
    for path in (tmp_path / "out" / "checkpoints").glob("*.ckpt"):
        path.unlink()
    loads, crcs = [], []
    real_load, real_testzip = torch.load, zipfile.ZipFile.testzip
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: loads.append(str(f)) or real_load(f, *a, **k))
    monkeypatch.setattr(zipfile.ZipFile, "testzip", lambda self: crcs.append(self.filename) or real_testzip(self))
    resumed = make_cfg(
        "model=mlp",
        "profile=tiny",
        "trainer.max_epochs=2",
        "logger=none",
        f"ckpt_path={moved}",
        "stretch_schedule=true",
    )
    train(resumed)
    assert loads.count(str(moved)) == 1 and crcs.count(str(moved)) == 1, (loads, crcs)


def test_output_folders_are_made_and_checked_at_start_but_a_remote_one_is_left_to_its_filesystem(
    make_cfg, tmp_path, monkeypatch
):
    """Every local folder the run writes to is made at start; a checkpoint dirpath on fsspec storage
    (`s3://...`, which Lightning's checkpointing supports) made a local `s3:` folder in the working directory."""
    from engine.runs.dirs import make_output_dirs

    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(
        "callbacks.model_checkpoint.dirpath=memory://bucket/best", f"callbacks.last_checkpoint.dirpath={tmp_path / 'l'}"
    )
    make_output_dirs(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l", "out"]


def test_a_refused_output_folder_leaves_none_of_the_folders_made_before_it(make_cfg, tmp_path):
    """Folders are made one after the other: one that cannot be written, found after a logger's new save_dir was
    made, left that save_dir behind."""
    from engine.errors import UserError
    from engine.runs.dirs import make_output_dirs

    cfg = make_cfg(
        f"logger.tensorboard.save_dir={tmp_path / 'new' / 'a' / 'b'}", "callbacks.model_checkpoint.dirpath=/proc/self"
    )
    with pytest.raises(UserError, match="callbacks.model_checkpoint.dirpath=/proc/self: not writable"):
        make_output_dirs(cfg)
    assert not (tmp_path / "new").exists()


def test_a_home_relative_folder_is_made_and_checked_in_the_home_folder(make_cfg, tmp_path, monkeypatch):
    """Lightning writes a dirpath of `~/x` under $HOME; the start made (and checked) a literal `./~/x` instead."""
    from engine.runs.dirs import make_output_dirs

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    make_output_dirs(make_cfg("callbacks.model_checkpoint.dirpath='~/checkpoints'"))
    assert (tmp_path / "home" / "checkpoints").is_dir() and not (tmp_path / "~").exists()
