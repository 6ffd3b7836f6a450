"""What a hostile tester found left over in sweeps: a NaN objective counted as a result, a search space checked only
by its trials, a sweeper n_jobs that the basic launcher ignores, and a DDP job's error that no file kept. A user's own
table regressor (tests/user_tables.py), composed as tests/test_sweep_metric.py does."""

import math

import pytest
import torch
import user_tables

pytestmark = pytest.mark.slow


class NanRegressor(user_tables.Regressor):
    """A user's model whose val/mse turns NaN from epoch `nan_from` on (a diverged run, a bad batch)."""

    def __init__(self, nan_from: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_from = nan_from

    def validation_step(self, batch, batch_idx):
        if self.current_epoch < self.nan_from:
            return super().validation_step(batch, batch_idx)
        self.log("val/mse", torch.tensor(math.nan))


class RankOneRaises(user_tables.Regressor):
    """A user's model that fails on DDP rank 1 only."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            raise RuntimeError("rank one broke on purpose")
        return super().training_step(batch, batch_idx)


TABLE = [
    "~model", "+model._target_=user_tables.Regressor", "~data", "+data._target_=user_tables.DiabetesData",
    "trainer.accelerator=cpu", "logger=csv", "monitor.metric=val/mse", "monitor.mode=min",
]  # fmt: skip
NAN = ["+model._target_=test_sweep_leftovers.NanRegressor" if t.startswith("+model._target_") else t for t in TABLE]
SEARCH = ["hparams_search=diabetes_optuna", "hydra.sweeper.params=null", "+model.lr=tag(log,interval(1e-3,1e-1))"]
TINY = {"PROJECT_PROFILE": "tiny"}


def _rows(tmp_path):
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    lines = (root / "summary.csv").read_text().splitlines()
    return root, [dict(zip(lines[0].split(","), row.split(",", 2) + [""])) for row in lines[1:]], lines


def test_a_nan_objective_is_a_failed_job_and_a_failed_trial(cli, tmp_path):
    """A NaN val/mse in the last epoch, as optimized_metric, was an "ok" row with a blank value and exit 0; a val/mse
    NaN from epoch 0 on was said to be "not logged". Both are failed jobs (and trials) with their reason, exit 2."""
    basic = cli("train.py", "-m", *NAN, "+model.nan_from=0,5", env=TINY, check=False)
    assert basic.returncode == 2
    root, _, lines = _rows(tmp_path)
    error = (root / "0" / "error.txt").read_text().splitlines()[0]
    assert error == (
        "optimized_metric=best/val/mse has no value: val/mse was logged, but never as a finite number (last: nan), "
        "so it has no best; the run diverged or the metric is broken, and this job counts as failed"
    )
    assert lines[1].startswith("1,ok,") and lines[2].startswith("0,failed,") and error in lines[2]

    study = cli(
        "train.py", "-m", *NAN, *SEARCH, "+model.nan_from=1", "optimized_metric=val/mse", "hydra.sweeper.n_trials=1",
        env=TINY, check=False,
    )  # fmt: skip
    assert study.returncode == 2
    said = (
        "optimized_metric=val/mse is nan, not a number a sweep can rank: the run diverged or the metric is broken; "
        "this job counts as failed (a lower learning rate, or gradient clipping, may keep it finite)"
    )
    assert f"error: sweep job 0: {said}\n" in study.stderr
    import optuna

    storage = f"sqlite:///{tmp_path}/logs/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    (trial,) = optuna.load_study(study_name=name, storage=storage).get_trials()
    assert (trial.state.name, trial.value, trial.user_attrs["error"]) == ("FAIL", None, said)
    newest = max((tmp_path / "logs" / "train" / "multiruns").glob("*"))
    assert "\n0,failed,," in (newest / "summary.csv").read_text()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            [*SEARCH, "model.nosuch=choice(1,2)"],
            "model.nosuch=choice(1,2): the config has no model.nosuch, so every trial would fail; search a key it "
            "has, or add this one with +model.nosuch=choice(1,2)",
        ),
        (  # the search's own params: the user's Regressor has no model.optimizer
            ["hparams_search=diabetes_optuna"],
            "model.optimizer.lr=tag(log, interval(1e-3, 1e-1)) (hydra.sweeper.params of hparams_search="
            "diabetes_optuna): the config has no model.optimizer.lr, so every trial would fail; search a key it has, "
            "or add this one with +model.optimizer.lr=tag(log, interval(1e-3, 1e-1))",
        ),
        (
            [*SEARCH, "data.batch_size=interval(8,64)"],
            "data.batch_size=interval(8,64): data.batch_size is an int (16), but this draws floats such as 25.8; use "
            "data.batch_size=int(interval(8,64)) (or float(...) if data.batch_size takes floats)",
        ),
        (
            [*SEARCH, "data.batch_size=range(8,64,0.5)"],
            "data.batch_size=range(8,64,0.5): data.batch_size is an int (16), but this draws floats such as 25.5; "
            "use data.batch_size=range(8, 64, 1) (or float(...) if data.batch_size takes floats)",
        ),
        (
            [*SEARCH, "hydra.sweeper.n_jobs=2"],
            "hydra.sweeper.n_jobs=2: the basic launcher runs one trial at a time; to run 2 at once use "
            "hydra/launcher=parallel hydra.launcher.n_jobs=2, or set hydra.sweeper.n_jobs=1",
        ),
    ],
)
def test_a_search_the_config_cannot_take_is_one_line_before_any_sweep_dir_or_study(cli, tmp_path, overrides, line):
    """docs/sweeps.md says the space is checked before a sweep dir or a study exists: a key the config lacks left
    both (with interrupted trials and a retry queued), floats for an int key failed every trial on its own, and
    hydra.sweeper.n_jobs=2 ran trials one by one, silently."""
    refused = cli("train.py", "-m", *TABLE, *overrides, env=TINY, check=False)
    assert (refused.returncode, refused.stderr) == (2, f"error: {line}\n")
    assert not (tmp_path / "logs").exists()  # no sweep dir, no study database


def test_a_ddp_job_that_fails_on_rank_1_says_why_in_error_txt(cli, tmp_path):
    """The job's error.txt and the summary said only "their error is printed above": the console's, in no file."""
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_epochs=1"]
    model = "+model._target_=test_sweep_leftovers.RankOneRaises"
    failed = cli("train.py", "-m", *[model if t.startswith("+model._target_") else t for t in TABLE], *ddp, "seed=1",
                 env=TINY, check=False)  # fmt: skip
    assert failed.returncode == 2
    root, _, lines = _rows(tmp_path)
    said = (root / "0" / "error.txt").read_text().splitlines()[0]
    assert said.startswith("its processes exited with code 1: rank 1 (pid ")
    assert "rank one broke on purpose" in said and "train_ddp_process_1.log" in said
    assert said in lines[1]
