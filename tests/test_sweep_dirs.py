"""A sweep's directories are claimed as a run's are: the sweep dir by one sweep, each job's dir by one job of it
(engine.runs.guard, engine.runs.dirs). Two jobs whose hydra.sweep.subdir names one folder, or two sweeps started at
once into one hydra.sweep.dir, wrote into each other's folders and exited 0 (a blind hostile try)."""

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

pytestmark = pytest.mark.slow

# conftest's helpers are imported in the tests, not here: the sweeps below import this module for its callbacks
RUN = [
    "model=mlp",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "test=false",
    "logger=none",
]
# Hydra's documented subdir pattern, with the swept key left out of the name: both jobs get one folder
SHARED_SUBDIR = [
    "hydra.sweep.subdir=${hydra.job.override_dirname}",
    "hydra.job.config.override_dirname.exclude_keys=[seed,print_config]",
]


class MeetAfterTheGuard(Callback):
    """Holds a sweep after the callbacks before it (the guard's check of its sweep dir) until the test says go: two
    sweeps started together both pass that check before either writes into the directory."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        (self.folder / str(os.getpid())).write_text("here")
        deadline = time.monotonic() + 120
        while not (self.folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def the_sweep(cwd: Path) -> Path:
    (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    return sweep


def shared_job_dir(sweep: Path) -> Path:
    (job,) = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return job


def test_jobs_whose_subdir_names_one_folder_stop_the_sweep_before_the_second_writes_there(cli, tmp_path):
    """Before: job 1 (seed=2) was refused by the checkpoint check only after it had written error.txt into job 0's
    folder, and the summary showed job 0's number under job 1's overrides."""
    proc = cli("train.py", "-m", *RUN, *SHARED_SUBDIR, "seed=1,2", check=False)
    one_error_line(
        proc,
        "error: hydra.sweep.subdir=${hydra.job.override_dirname} gives jobs 0 and 1 of this sweep one directory, ",
        "name one that tells the jobs apart, e.g. hydra.sweep.subdir=${hydra.job.num}",
    )
    job = shared_job_dir(the_sweep(tmp_path))
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
    assert (job / "fit_metrics.json").is_file() and not (job / "error.txt").exists()  # job 0's results, and no more
    assert (job / ".project_run").read_text().endswith(" job 0")


def test_a_refused_job_leaves_the_first_jobs_hydra_files_as_they_were(cli, tmp_path):
    """Hydra saves a job's .hydra/ before any callback runs: the job log's name (conf/hydra/default.yaml) claims the
    folder first, through ${sweep_job_dir:...}."""
    proc = cli("train.py", "-m", *RUN, *SHARED_SUBDIR, "seed=1,2", check=False)
    one_error_line(proc, "gives jobs 0 and 1 of this sweep one directory")
    job = shared_job_dir(the_sweep(tmp_path))
    assert "seed=1" in (job / ".hydra" / "overrides.yaml").read_text()
    assert OmegaConf.load(job / ".hydra" / "config.yaml").seed == 1


def test_parallel_jobs_whose_subdir_names_one_folder_are_refused_not_merged(cli, tmp_path):
    """Before: exit 0, both jobs' checkpoints in one folder (epoch_000.ckpt and epoch_000-v1.ckpt, one last.ckpt),
    and a summary of "1 jobs: 1 ok" without the other job."""
    proc = cli("train.py", "-m", "hydra/launcher=parallel", *RUN, *SHARED_SUBDIR, "seed=1,2", check=False)
    one_error_line(proc, "gives jobs ", " of this sweep one directory, ", "hydra.sweep.subdir=${hydra.job.num}")
    sweep = the_sweep(tmp_path)
    job = shared_job_dir(sweep)
    assert not list(job.glob("checkpoints/*-v*.ckpt")) and not (job / "error.txt").exists()
    assert not (sweep / "summary.md").exists()


def test_two_sweeps_started_at_once_into_one_sweep_dir_one_is_refused(tmp_path):
    """Before: the guard refused a sweep dir that already held files, so two sweeps started together both passed it
    and shared the job folders 0 and 1: the summary's row for one sweep's job held the other's numbers."""
    from conftest import REPO, cli_env

    meet = tmp_path / "meet"
    meet.mkdir()
    sweep_dir = tmp_path / "race"
    common = [*RUN, f"hydra.sweep.dir={sweep_dir}", f"+hydra.callbacks.meet._target_={__name__}.MeetAfterTheGuard"]
    lrs = {"a": "0.05,0.3", "b": "0.001,0.002"}
    sweeps = {
        name: subprocess.Popen(
            [
                sys.executable,
                str(REPO / "train.py"),
                "-m",
                *common,
                f"+hydra.callbacks.meet.folder={meet}",
                f"model.optimizer.lr={values}",
            ],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, values in lrs.items()
    }
    deadline = time.monotonic() + 300
    while len(list(meet.iterdir())) < 2 and all(p.poll() is None for p in sweeps.values()):
        assert time.monotonic() < deadline, "neither sweep reached the meeting point"
        time.sleep(0.05)
    (meet / "go").write_text("go")  # both past the guard's look at the directory, or one refused by it
    ended = {name: (p.wait(timeout=600), p.stderr.read()) for name, p in sweeps.items()}
    assert sorted(code for code, _ in ended.values()) == [0, 2], ended
    (winner,) = [name for name, (code, _) in ended.items() if code == 0]
    (loser,) = set(lrs) - {winner}
    line = one_error_line(subprocess.CompletedProcess([], 2, "", ended[loser][1]), f"hydra.sweep.dir={sweep_dir} ")
    assert line.endswith("; name a new directory, or leave hydra.sweep.dir out for a fresh one"), line
    for num, lr in enumerate(lrs[winner].split(",")):  # each job folder holds the winner's job alone
        job = sweep_dir / str(num)
        assert f"model.optimizer.lr={lr}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
    with (sweep_dir / "summary.csv").open() as summary:
        swept = sorted(override for row in csv.DictReader(summary) for override in row["overrides"].split(" "))
    assert [o for o in swept if o.startswith("model.optimizer.lr=")] == [
        f"model.optimizer.lr={lr}" for lr in sorted(lrs[winner].split(","))
    ]


def test_a_job_dir_outside_the_sweep_that_holds_a_runs_files_is_refused_and_left_as_it_was(tmp_path):
    from engine.errors import UserError
    from engine.runs.dirs import CLAIM, claim_job_dir

    other = tmp_path / "other_run"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_bytes(b"another run's")
    with pytest.raises(UserError, match="already holds an earlier run's files"):
        claim_job_dir(other, tmp_path / "sweep", "sweep-owner", 0, str(other))
    assert not (other / CLAIM).exists() and (other / "checkpoints" / "last.ckpt").read_bytes() == b"another run's"


def test_a_process_refused_a_folder_it_made_never_removes_it(tmp_path):
    """The loser of a claim may have made the folder itself (its mkdir came first): the winner's files stay."""
    from engine.errors import UserError
    from engine.runs.dirs import CLAIM, CREATED, claim, remove_if_unused

    folder = tmp_path / "race"
    folder.mkdir()
    CREATED.add(str(folder.resolve()))  # made by this process
    (folder / CLAIM).write_text("another sweep")  # claimed by another first
    (folder / "multirun.yaml").write_text("its config")
    with pytest.raises(UserError, match="is being used by another sweep started at the same time"):
        claim(folder, "hydra.sweep.dir", what="sweep")
    remove_if_unused(folder)
    assert (folder / "multirun.yaml").is_file() and (folder / CLAIM).read_text() == "another sweep"
