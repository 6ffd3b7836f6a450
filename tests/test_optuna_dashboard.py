"""Looking at an Optuna study: the real optuna-dashboard server on the study a real sweep made, read through its HTTP
API, and Optuna's own plots in the sweep summary (src/hydra_plugins/engine_optuna_sweeper/plots.py)."""

import csv
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import REPO, cli_env, run_python
from PIL import Image

from hydra_plugins.engine_optuna_sweeper import plots

PLOTS = ("optuna_history.png", "optuna_importances.png", "optuna_intermediate.png")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, Path]:
    """`python train.py -m hparams_search=digits_optuna`, 4 trials at the test profile's size, searching the learning
    rate and the width of a user's own net (tests/user_models.py) instead of LeNet's: (working dir, sweep dir)."""
    work = tmp_path_factory.mktemp("work")
    search = [
        "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.params=null",
        "~model.net", "+model.net._target_=user_models.ResidualNet",
        "model.optimizer.lr=tag(log,interval(1e-4,1e-2))", "+model.net.width=int(interval(4,16))",
    ]  # fmt: skip
    proc = run_python([sys.executable, str(REPO / "train.py"), *search], work, cli_env(PROJECT_PROFILE="tiny"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root,) = (work / "logs" / "train" / "multiruns").iterdir()
    return work, root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=30).read())


@pytest.fixture(scope="module")
def dashboard(sweep):
    """`optuna-dashboard sqlite:///logs/optuna.db`, as the README starts it, on a free loopback port."""
    work, _ = sweep
    port = _free_port()
    command = [str(Path(sys.executable).with_name("optuna-dashboard")), "sqlite:///logs/optuna.db"]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            get(f"{url}/api/studies")
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "optuna-dashboard did not start"
            time.sleep(0.5)
    yield url
    proc.send_signal(signal.SIGINT)  # Ctrl-C: a quick shutdown (SIGTERM makes gunicorn wait for its workers)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summary_rows(root: Path) -> dict[str, dict[str, str]]:
    return {row["job"]: row for row in csv.DictReader((root / "summary.csv").open())}


def overrides(row: dict[str, str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in row["overrides"].split())


@pytest.mark.slow
def test_the_dashboard_shows_the_trials_the_sweep_summary_lists(sweep, dashboard):
    _, root = sweep
    (study,) = get(f"{dashboard}/api/studies")["study_summaries"]
    named = yaml.safe_load((root / "optuna_study.yaml").read_text())  # the sweep names its study
    assert study["study_name"] == named["study_name"] and study["directions"] == ["maximize"]
    detail = get(f"{dashboard}/api/studies/{study['study_id']}")
    rows = summary_rows(root)
    trials = {str(t["number"]): t for t in detail["trials"]}
    assert sorted(trials) == sorted(rows) == ["0", "1", "2", "3"]  # one trial per job, numbered as the job dirs
    state = {"ok": "Complete", "pruned": "Pruned", "failed": "Fail"}
    for job, row in rows.items():
        trial = trials[job]
        assert trial["state"] == state[row["status"]]
        params = {p["name"].lstrip("+"): p["param_external_value"] for p in trial["params"]}
        assert params.keys() == {"model.optimizer.lr", "model.net.width"}
        assert params.items() <= overrides(row).items()  # the values the job ran with
        if trial["state"] == "Complete":
            assert f"{trial['values'][0]:.4g}" == row["best/val/acc"]
        assert [v["step"] for v in trial["intermediate_values"]] == list(range(int(row["epochs"])))
        assert {"key": "output_dir", "value": str(root / job)} in trial["user_attrs"]
    (best,) = detail["best_trials"]  # the best of the completed jobs (of one of them, where several tie)
    best_of_jobs = max(float(r["best/val/acc"]) for r in rows.values() if r["status"] == "ok")
    assert f"{best['values'][0]:.4g}" == rows[str(best["number"])]["best/val/acc"] == f"{best_of_jobs:.4g}"


@pytest.mark.slow
def test_the_summary_adds_optunas_plots_of_the_study(sweep):
    _, root = sweep
    text = (root / "summary.md").read_text()
    for name in PLOTS:
        with Image.open(root / name) as image:
            assert image.format == "PNG" and image.width > 400 and image.height > 300, name
        assert f"- [{name}]({name}): " in text
    completed = sorted(int(job) for job, row in summary_rows(root).items() if row["status"] == "ok")
    # read back from the drawn figure: every completed trial is a point of the history
    assert f"the objective of the {len(completed)} completed trials ({', '.join(map(str, completed))})" in text
    assert "for trials 0, 1, 2, 3" in text  # every trial's per-epoch values, pruned ones too
    importances = text.split("optuna_importances.png): ")[1].splitlines()[0]
    assert "+model.net.width" in importances and "model.optimizer.lr" in importances


def test_a_plot_that_cannot_be_drawn_is_a_line_saying_why(tmp_path):
    """One searched parameter, one completed trial, no per-epoch values: the history only; then the database gone."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="one", storage=storage, direction="maximize")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    (tmp_path / "optuna_study.yaml").write_text(yaml.safe_dump({"study_name": "one", "storage": storage}))
    text = plots.write(tmp_path)
    assert "- [optuna_history.png](optuna_history.png): the objective of the 1 completed trials (0)" in text
    assert "- optuna_importances.png: not drawn: needs at least 2 searched parameters, this search has 1" in text
    assert "- optuna_intermediate.png: not drawn: no trial reported per-epoch values" in text
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["optuna_history.png"]

    (tmp_path / "optuna.db").unlink()
    text = plots.write(tmp_path)
    assert f"Not drawn: {tmp_path}/optuna.db does not exist any more." in text
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "optuna.db").exists()  # no stale plot, no new db

    (tmp_path / "optuna_study.yaml").write_text(yaml.safe_dump({"study_name": "one", "storage": None}))
    assert "study one was kept in memory (hydra.sweeper.storage=null) and ended with its sweep" in plots.write(tmp_path)
