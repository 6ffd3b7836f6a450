"""The Optuna search (hparams_search=digits_optuna, src/hydra_plugins/engine_optuna_sweeper) through the real CLI."""

import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from conftest import REPO, WARM, cli_env

pytestmark = pytest.mark.slow

SEARCH = ["-m", "hparams_search=digits_optuna"]
TINY = {"PROJECT_PROFILE": "tiny"}


def trials(cwd: Path) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{cwd}/logs/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def sweep_dirs(cwd: Path) -> list[Path]:
    return sorted((cwd / "logs" / "train" / "multiruns").glob("*"))


def test_the_profile_shrinks_the_search_and_bad_sweeper_keys_are_one_line(cli, tmp_path):
    search = ["hparams_search=digits_optuna", "profile=tiny"]
    cfg = cli("train.py", *search, "--cfg", "hydra", "--package", "hydra.sweeper")
    assert "n_trials: 3" in cfg.stdout and "direction: ${monitor.mode}" in cfg.stdout  # max -> maximize
    refused = {
        "hydra.sweeper.direction=up": "hydra.sweeper.direction=up: use maximize or minimize (or max, min)",
        "hydra.sweeper.storage=sqlite:////proc/none/optuna.db": "hydra.sweeper.storage=sqlite:////proc/none/optuna.db:"
        " its folder cannot be made (No such file or directory); use a storage on a writable disk",
        "hydra/launcher=parallel hydra.sweeper.n_jobs=3": "hydra.sweeper.n_jobs=3: more trials at once than the "
        "launcher's 2 workers; use hydra.sweeper.n_jobs=2, or raise hydra.launcher.n_jobs",
        "hydra.sweeper.direction=minimize": "hydra.sweeper.direction=minimize, but monitor.mode=max: the trials return "
        "val/acc (higher is better), so the best trial would be the worst; use hydra.sweeper.direction=maximize (to "
        "minimize another metric, set monitor.metric and monitor.mode)",
    }
    for overrides, line in refused.items():
        bad = cli("train.py", *SEARCH, *overrides.split(), check=False)
        assert (bad.returncode, bad.stderr) == (2, f"error: {line}\n")
    assert not (tmp_path / "logs").exists()  # no sweep dir, no database left behind


def test_a_killed_search_resumes_without_repeating_finished_trials(cli, tmp_path):
    python = str(WARM.python_on_path() / "python")  # warm: the sweep is the process its study's lock names
    command = [python, str(REPO / "train.py"), *SEARCH, "hydra.sweeper.n_trials=4"]
    first = subprocess.Popen(
        command, cwd=tmp_path, env=cli_env(**TINY), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while not list(tmp_path.glob("logs/train/multiruns/*/1/.hydra")):  # trial 0 is done, trial 1 has started
        assert first.poll() is None and time.time() < deadline, first.stderr.read().decode() if first.stderr else ""
        time.sleep(0.05)
    (lock,) = [p for p in tmp_path.rglob(".*.lock") if p.read_text().startswith("pid ")]
    sweep = int(lock.read_text().split()[1])
    os.kill(sweep, signal.SIGSTOP)  # hold trial 1 where it is: on a slow machine it could end before the kill
    # a second sweep on the study while the first runs: refused in one line, the first's trial left alone
    second = cli("train.py", *SEARCH, "hydra.sweeper.n_trials=4", env=TINY, check=False)
    assert second.returncode == 2
    assert second.stderr.startswith("error: study ") and "is being run by another sweep (pid " in second.stderr
    assert len(second.stderr.splitlines()) == 1 and len(sweep_dirs(tmp_path)) == 1
    os.kill(sweep, signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    killed = {t.number: t.state.name for t in trials(tmp_path)}
    assert killed[0] == "COMPLETE" and killed[1] == "RUNNING"

    cli("train.py", *SEARCH, "hydra.sweeper.n_trials=4", env=TINY)
    after = trials(tmp_path)
    counted = [t for t in after if not t.user_attrs.get("interrupted")]
    assert len(counted) == 4 and all(t.state.name in ("COMPLETE", "PRUNED") for t in counted)
    assert [t.number for t in after if t.user_attrs.get("interrupted")] == [1]  # the killed one, not counted
    retry = next(t for t in after if t.user_attrs.get("retry_of") == 1)
    assert retry.params == after[1].params  # it ran again first, with its parameters
    assert [t.number for t in counted].count(0) == 1  # trial 0 did not run again
    first_dir, second_dir = sweep_dirs(tmp_path)
    assert sorted(p.name for p in second_dir.iterdir() if p.is_dir()) == [str(t.number) for t in counted[1:]]
    assert "best/val/acc" in (second_dir / "summary.md").read_text()

    again = cli("train.py", *SEARCH, "hydra.sweeper.n_trials=4", env=TINY)
    assert "4 of 4 trials done" in again.stdout + again.stderr and len(trials(tmp_path)) == len(after)


def test_a_pruned_trial_stops_early_without_failing_the_sweep(cli, tmp_path):
    proc = cli(
        "train.py",
        *SEARCH,
        "hydra.sweeper.n_trials=1",
        "~hydra.sweeper.pruner.n_startup_trials",
        "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
        "+hydra.sweeper.pruner.lower=1.01",  # no accuracy reaches it: pruned at the first report after warm-up
        "hydra.sweeper.pruner.n_warmup_steps=0",
        env=TINY,
    )
    (trial,) = trials(tmp_path)
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [0]
    (root,) = sweep_dirs(tmp_path)
    assert (root / "0" / "pruned.json").is_file() and (root / "0" / "test_metrics.json").is_file()
    assert "error" not in proc.stderr
    assert (root / "summary.csv").read_text().splitlines()[1].split(",")[1:5:3] == ["pruned", "1"]  # 1 epoch of 2


def test_a_search_of_a_metric_lower_is_better_minimizes_it(cli, tmp_path):
    """The table regression's val/mse: the study minimizes, and its best trial is the one of the lowest value
    (every other search here maximizes val/acc, so min mapped to maximize passed them all)."""
    cli("train.py", "-m", "experiment=diabetes", "hparams_search=diabetes_optuna", "test=false", env=TINY)
    found = [t for t in trials(tmp_path) if t.state == optuna.trial.TrialState.COMPLETE]
    storage = f"sqlite:///{tmp_path}/logs/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE and len(found) == 3
    assert study.best_value == min(t.value for t in found) and len({t.value for t in found}) == 3
