"""The sweep summary (src/engine/sweeps/summary.py): written when a sweep ends, and by its own command."""

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import cli_env, run_python

pytestmark = pytest.mark.slow


def test_a_sweep_with_a_failed_job_gets_its_summary_before_the_non_zero_exit(cli, tmp_path):
    proc = cli(
        "train.py", "-m", "model=mlp", "model.optimizer.lr=0.01,-1,0.001", env={"PROJECT_PROFILE": "tiny"}, check=False
    )
    assert proc.returncode == 2
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    rows = list(csv.DictReader((root / "summary.csv").open()))
    assert [r["job"] for r in rows[2:]] == ["1"] and rows[2]["status"] == "failed"  # no metric: last
    assert rows[2]["error"] == "model.optimizer: ValueError: Invalid learning rate: -1"
    ok = rows[:2]
    assert all(r["status"] == "ok" and r["epochs"] == "2" and float(r["wall_s"]) > 0 for r in ok)
    assert float(ok[0]["best/val/acc"]) >= float(ok[1]["best/val/acc"]) and ok[0]["test/acc"]
    assert {r["overrides"] for r in rows} == {
        f"profile=tiny model=mlp model.optimizer.lr={lr}" for lr in (0.01, -1, 0.001)
    }
    assert (root / "summary.png").stat().st_size > 10_000
    assert "| 1 | failed |" in (root / "summary.md").read_text()

    # the command rewrites it from the directory alone, even with a job that left nothing but its config
    (root / "1" / "error.txt").unlink()
    (root / "0" / "fit_metrics.json").unlink()
    (root / "0" / "test_metrics.json").unlink()
    (root / "summary.csv").unlink()
    again = run_python([sys.executable, "-m", "engine.sweeps.summary", str(root)], tmp_path, cli_env())
    assert again.returncode == 0, again.stderr
    statuses = {r["job"]: r["status"] for r in csv.DictReader((root / "summary.csv").open())}
    assert statuses == {"0": "unfinished", "1": "unfinished", "2": "ok"}
    assert "3 jobs: 1 ok, 2 unfinished" in again.stdout

    # a sweep killed before its last job started: that job is a row too, with the overrides it would have run with
    shutil.rmtree(root / "2")
    again = run_python([sys.executable, "-m", "engine.sweeps.summary", str(root)], tmp_path, cli_env())
    assert again.returncode == 0, again.stderr
    rows = {r["job"]: r for r in csv.DictReader((root / "summary.csv").open())}
    assert {job: r["status"] for job, r in rows.items()} == {"0": "unfinished", "1": "unfinished", "2": "not started"}
    assert rows["2"]["overrides"] == "profile=tiny model=mlp model.optimizer.lr=0.001"
    assert "3 jobs: 2 unfinished, 1 not started" in again.stdout


def test_the_command_refuses_a_directory_that_is_no_sweep(tmp_path: Path):
    proc = run_python([sys.executable, "-m", "engine.sweeps.summary", str(tmp_path)], tmp_path, cli_env())
    assert (
        proc.returncode == 2 and proc.stderr == f"error: {tmp_path}: no sweep jobs in it (directories with .hydra/)\n"
    )


def test_a_job_a_signal_stopped_is_interrupted_not_ok(tmp_path: Path):
    """A job that a signal stopped wrote its metrics so far with `"status": "interrupted"` (resumable from its
    last.ckpt); its row said `ok`, and sorted among the finished jobs by its partial metric. A job that finished,
    and one killed before writing anything, for comparison."""
    from engine.sweeps.summary import read_sweep

    for name, fit in {
        "0": {"status": "ok", "best/val/acc": 0.9},
        "1": {"status": "interrupted", "best/val/acc": 0.95},
    }.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "fit_metrics.json").write_text(json.dumps(fit))
    (tmp_path / "2" / ".hydra").mkdir(parents=True)
    jobs, _ = read_sweep(tmp_path)
    assert [(job.name, job.status) for job in jobs] == [("0", "ok"), ("1", "interrupted"), ("2", "unfinished")]
    proc = run_python([sys.executable, "-m", "engine.sweeps.summary", str(tmp_path)], tmp_path, cli_env())
    assert "3 jobs: 1 ok, 1 interrupted, 1 unfinished" in proc.stdout, proc.stdout + proc.stderr


def test_a_basic_sweeps_planned_jobs_that_never_started_are_rows_and_no_others(tmp_path: Path):
    """From multirun.yaml, as Hydra's basic sweeper expands it (its params first, then the command line): job 2 never
    started. Job 1's folder is there without `.hydra/` (hydra.output_subdir=null, or a job just starting): a row of
    its own, with its planned overrides. An Optuna sweep's trials are not known ahead: no such rows."""
    from engine.sweeps.summary import read_sweep

    def sweep(target: str) -> Path:
        root = tmp_path / target.rsplit(".", 1)[-1]
        (root / "0" / ".hydra").mkdir(parents=True)
        (root / "0" / "fit_metrics.json").write_text(json.dumps({"status": "ok", "best/val/acc": 0.9}))
        (root / "1").mkdir()
        hydra = {
            "sweeper": {"_target_": target, "params": {"model.optimizer.lr": "0.1,0.01,0.001"}},
            "sweep": {"subdir": "${hydra.job.num}"},
            "overrides": {"task": ["seed=1", "model.net.hidden=[8,8]"]},
        }
        (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))
        return root

    jobs, _ = read_sweep(sweep("hydra._internal.core_plugins.basic_sweeper.BasicSweeper"))
    planned = {"seed": "1", "model.net.hidden": "[8,8]"}
    assert [(job.name, job.status, job.overrides) for job in jobs] == [
        ("0", "ok", {"model.optimizer.lr": "0.1", **planned}),
        ("1", "unfinished", {"model.optimizer.lr": "0.01", **planned}),
        ("2", "not started", {"model.optimizer.lr": "0.001", **planned}),
    ]
    jobs, _ = read_sweep(sweep("hydra_plugins.engine_optuna_sweeper.optuna_sweeper.OptunaSweeper"))
    assert [(job.name, job.status) for job in jobs] == [("0", "ok")]


def test_a_job_killed_during_its_test_is_unfinished_not_ok(tmp_path: Path):
    """Its fit's metrics are there, but its config asked for a test (`test: true`) that wrote none."""
    from engine.sweeps.summary import read_sweep

    for name, test in {"0": True, "1": True, "2": False}.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": True, "test": test}))
        (tmp_path / name / "fit_metrics.json").write_text(json.dumps({"status": "ok", "best/val/acc": 0.9}))
    (tmp_path / "0" / "test_metrics.json").write_text(json.dumps({"status": "ok", "test/acc": 0.8}))
    jobs, _ = read_sweep(tmp_path)
    assert sorted((job.name, job.status) for job in jobs) == [("0", "ok"), ("1", "unfinished"), ("2", "ok")]


def test_a_sharded_jobs_epochs_are_read_from_its_checkpoint_folder(tmp_path: Path):
    """fsdp's last.ckpt is a folder of shards and a meta.pt: its row's epochs were blank."""
    import torch

    from engine.sweeps.summary import read_sweep

    progress = {"fit_loop": {"epoch_progress": {"current": {"processed": 3}}}}
    for name in ("0", "1"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "fit_metrics.json").write_text(json.dumps({"status": "ok", "best/val/acc": 0.9}))
    (tmp_path / "0" / "checkpoints" / "last.ckpt").mkdir(parents=True)  # fsdp's
    torch.save({"epoch": 2, "loops": progress}, tmp_path / "0" / "checkpoints" / "last.ckpt" / "meta.pt")
    (tmp_path / "1" / "checkpoints").mkdir()
    torch.save({"epoch": 2, "loops": progress}, tmp_path / "1" / "checkpoints" / "last.ckpt")  # one file
    jobs, _ = read_sweep(tmp_path)
    assert [job.epochs for job in jobs] == [3, 3]


def test_a_models_own_metric_names_get_their_test_column_and_the_csv_keeps_every_digit(tmp_path: Path):
    """A model logging val_rmse and test_rmse: the test column was `test/val_rmse`, always empty; summary.csv, read
    by scripts, rounded to 4 significant figures. Ranked as monitor.mode says, lowest first."""
    monitor = {"metric": "val_rmse", "mode": "min"}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"monitor": monitor}))
    for name, (val, test) in {"0": (0.52345678912345, 0.61234567891234), "1": (0.4123456789, 0.5)}.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "fit_metrics.json").write_text(json.dumps({"status": "ok", "best/val_rmse": val}))
        (tmp_path / name / "test_metrics.json").write_text(json.dumps({"status": "ok", "test_rmse": test}))
    proc = run_python([sys.executable, "-m", "engine.sweeps.summary", str(tmp_path)], tmp_path, cli_env())
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["job"], r["best/val_rmse"], r["test_rmse"]) for r in rows] == [
        ("1", "0.4123456789", "0.5"),
        ("0", "0.52345678912345", "0.61234567891234"),
    ]
    assert "| 0 | ok | 0.5235 | 0.6123 |" in proc.stdout


def test_the_importances_of_a_study_whose_first_trial_was_cut_off_count_its_searched_parameters(tmp_path: Path):
    """No trial completed yet: summary.md said the search has 0 searched parameters (counted from completed trials)
    while it has 3."""
    import optuna

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="cut", storage=storage, direction="maximize")
    trial = study.ask()
    for name in ("model.optimizer.lr", "data.batch_size", "model.net.hidden"):
        trial.suggest_float(name, 0.1, 1.0)
    trial.set_user_attr("interrupted", True)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    (tmp_path / "optuna_study.yaml").write_text(yaml.safe_dump({"study_name": "cut", "storage": storage}))
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    proc = run_python([sys.executable, "-m", "engine.sweeps.summary", str(tmp_path)], tmp_path, cli_env())
    assert proc.returncode == 0, proc.stderr
    assert "- optuna_importances.png: not drawn: needs at least 2 completed trials, the study has 0" in proc.stdout
