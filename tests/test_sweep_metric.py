"""What a sweep optimizes is a form of monitor.metric, ranked as monitor.mode says (src/engine/sweeps/objective.py): the
summary's order, the Optuna study's direction and identity, and its pruner all follow it. A user's own table regressor
(tests/user_tables.py), which logs val/mse (lower is better) and train/mse."""

from pathlib import Path

import optuna
import pytest

pytestmark = pytest.mark.slow

TABLE = [
    "~model", "+model._target_=user_tables.Regressor", "~data", "+data._target_=user_tables.DiabetesData",
    "trainer.accelerator=cpu", "logger=csv",
]  # fmt: skip
SEARCH = ["hparams_search=diabetes_optuna", "hydra.sweeper.params=null", "+model.lr=tag(log,interval(1e-3,1e-1))"]
TINY = {"PROJECT_PROFILE": "tiny"}
PRUNER = "hydra.sweeper.pruner={_target_:optuna.pruners.MedianPruner}"


def test_an_optimized_metric_that_is_not_the_monitors_is_refused_before_any_sweep_dir_or_study(cli, tmp_path):
    """It was ranked in monitor.mode's direction (the tester's higher-is-better r2 sorted worst first), its study
    minimized it, and the pruner judged monitor.metric for it."""
    line = (
        "error: optimized_metric=train/mse is not monitor.metric (val/mse): a sweep ranks its jobs as monitor.mode "
        "(min) says, and checkpoints, early stopping and the pruner judge monitor.metric; set monitor.metric=train/mse "
        "monitor.mode=<max or min> instead (and leave optimized_metric unset)\n"
    )
    monitor = ["monitor.metric=val/mse", "monitor.mode=min"]
    for sweep in (["+model.lr=0.001,0.3"], SEARCH, [*SEARCH, "hydra.sweeper.direction=maximize"]):
        bad = cli("train.py", "-m", *TABLE, *monitor, *sweep, "optimized_metric=train/mse", env=TINY, check=False)
        assert (bad.returncode, bad.stderr) == (2, line)
    pruning = ["+callbacks.optuna_pruning._target_=engine.sweeps.pruning.OptunaPruning"]
    bad = cli(
        "train.py", "-m", *TABLE, *monitor, *SEARCH, *pruning, "+callbacks.optuna_pruning.monitor=train/mse",
        env=TINY, check=False,
    )  # fmt: skip
    assert (bad.returncode, bad.stderr) == (
        2,
        "error: callbacks.optuna_pruning.monitor=train/mse: the pruner would judge another metric than the study "
        "optimizes (val/mse); set callbacks.optuna_pruning.monitor=${monitor.metric}\n",
    )
    assert not (tmp_path / "logs").exists()  # no sweep dir, no study database

    # made the monitor, it is what the jobs are ranked by, lowest first
    cli("train.py", "-m", *TABLE, "monitor.metric=train/mse", "monitor.mode=min", "+model.lr=0.001,0.3", env=TINY)
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    rows = [line.split(",") for line in (root / "summary.csv").read_text().splitlines()]
    assert rows[0][2] == "best/train/mse" and float(rows[1][2]) <= float(rows[2][2])


def studies(cwd: Path) -> dict[str, list[str]]:
    storage = f"sqlite:///{cwd}/logs/optuna.db"
    return {
        name: [t.state.name for t in optuna.load_study(study_name=name, storage=storage).get_trials()]
        for name in optuna.get_all_study_names(storage)
    }


def test_a_config_file_that_changes_the_metric_starts_another_study(cli, tmp_path):
    """The study's name came from the search space, direction and command line only: a metric changed in a config
    file continued the old study, comparing the last val/mse with the best ones. A study named by the user is refused
    when it holds another metric."""
    experiment = tmp_path / "conf" / "experiment" / "mine.yaml"
    experiment.parent.mkdir(parents=True)
    command = ["train.py", "-m", "--config-dir", str(tmp_path / "conf"), *TABLE, "experiment=mine", *SEARCH]
    one = ["hydra.sweeper.n_trials=1"]

    def run(optimized: str, *overrides: str):
        experiment.write_text(f"# @package _global_\nmonitor:\n  metric: val/mse\n  mode: min\n{optimized}")
        return cli(*command, *one, *overrides, env=TINY, check=False)

    for optimized in ("", "optimized_metric: val/mse\n"):
        assert run(optimized).returncode == 0
    assert sorted(studies(tmp_path).values()) == [["COMPLETE"]] * 2  # one trial each: the first was not continued

    assert run("", "hydra.sweeper.study_name=named").returncode == 0
    refused = run("optimized_metric: val/mse\n", "hydra.sweeper.study_name=named")
    storage = f"sqlite:///{tmp_path}/logs/optuna.db"
    assert (refused.returncode, refused.stderr) == (
        2,
        f"error: study named in {storage} holds trials of best/val/mse, these return val/mse; use another "
        "hydra.sweeper.study_name (or monitor.metric and optimized_metric as that study had them)\n",
    )
    assert studies(tmp_path)["named"] == ["COMPLETE"]
    assert len(list((tmp_path / "logs" / "train" / "multiruns").glob("*"))) == 3  # the refused one left none


def test_a_pruner_that_cannot_reach_a_study_kept_in_memory_is_one_line_naming_a_storage(cli, tmp_path):
    """hydra/launcher=parallel with hydra.sweeper.storage=null pruned nothing, silently: its workers are other
    processes. Refused at start; a DDP trial, whose ranks run as a process of their own, fails in one line."""
    memory = [*TABLE, "monitor.metric=val/mse", "monitor.mode=min", *SEARCH, PRUNER, "hydra.sweeper.storage=null"]
    refused = cli("train.py", "-m", "hydra/launcher=parallel", *memory, env=TINY, check=False)
    assert (refused.returncode, refused.stderr) == (
        2,
        "error: hydra.sweeper.storage=null keeps the study in this process, which the jobs of hydra/launcher=parallel "
        "run outside: no trial would be pruned; set hydra.sweeper.storage=sqlite:///<path>.db (or "
        "hydra.sweeper.pruner=null)\n",
    )
    assert not (tmp_path / "logs").exists()

    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "hydra.sweeper.n_trials=1"]
    failed = cli("train.py", "-m", *memory, *ddp, env=TINY, check=False)
    assert failed.returncode == 2
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    said = (root / "0" / "error.txt").read_text().splitlines()[0]
    assert said == (
        "its ranks run in processes of their own, which cannot reach a study kept in memory "
        "(hydra.sweeper.storage=null): no trial would be pruned; set hydra.sweeper.storage=sqlite:///<path>.db "
        "(or hydra.sweeper.pruner=null)"
    )
    assert f"): {said}" in failed.stderr and "Traceback" not in failed.stderr
