"""`tune=lr|batch_size`: Lightning's finders from the command line, on a user's net and on a LightningModule of
another task; `tune.apply=true` trains exactly as the printed override would."""

import json
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, WARM, cli_env, run_dirs
from hydra.utils import instantiate

from engine.errors import UserError
from engine.tasks import tune
from engine.tasks.seeding import seed_run

pytestmark = pytest.mark.slow

TINY = {"PROJECT_PROFILE": "tiny"}
USER_NET = ["~model.net", "+model.net._target_=user_models.TutorialCNN"]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_lr_finder_on_a_users_net_writes_its_plot_and_the_override_and_trains_nothing(cli, tmp_path):
    proc = cli("train.py", *USER_NET, "tune=lr", env=TINY)
    (run,) = run_dirs(tmp_path / "logs")
    report = json.loads((run / "tune.json").read_text())
    assert report["key"] == "model.optimizer.lr" and 1e-6 <= report["value"] <= 1.0
    assert report["override"] == f"model.optimizer.lr={report['value']}"
    assert len(report["lr"]) == len(report["loss"]) == 100  # tune.num_training steps, not the profile's epochs
    assert f"train with: python train.py {report['override']}" in proc.stdout + proc.stderr
    assert _png_size(run / "lr_find.png")[0] >= 400
    assert not (run / "fit_metrics.json").exists() and not (run / "checkpoints").exists()  # no empty folders either
    assert not [p for p in run.rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert not list(tmp_path.rglob(".lr_find*")) and not (run / ".tune").exists()  # Lightning's scratch checkpoint


def test_apply_trains_with_the_value_as_the_override_would(cli, tmp_path):
    """model=autoencoder (its lr is model.lr): tune.apply=true ends with the same weights as typing the override."""
    cli("train.py", "model=autoencoder", "tune=lr", "tune.apply=true", env=TINY, cwd=tmp_path / "tuned")
    (tuned,) = run_dirs(tmp_path / "tuned" / "logs")
    report = json.loads((tuned / "tune.json").read_text())
    assert report["key"] == "model.lr"
    saved = torch.load(tuned / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["run_config"]["model"]["lr"] == report["value"]  # what the run's config and HParams show
    assert (tuned / "fit_metrics.json").is_file() and (tuned / "test_metrics.json").is_file()

    cli("train.py", "model=autoencoder", report["override"], env=TINY, cwd=tmp_path / "typed")
    (typed,) = run_dirs(tmp_path / "typed" / "logs")
    again = torch.load(typed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    for name, value in saved["state_dict"].items():
        assert torch.equal(value, again[name]), name


def test_a_tuned_run_stopped_while_training_says_a_command_that_continues_it(tmp_path):
    """It said `ckpt_path=... added to the run's command`, and that command (tune=lr, tune.apply=true) was refused:
    the finders tune a fresh model. Now the tune overrides give way to the value found, as its override."""
    import shlex

    from test_fault_tolerance import RUN, train

    args = [*RUN, "tune=lr", "tune.apply=true"]
    stopped = train(tmp_path / "work", *args, env={"KILL_AT_STEP": "4", "KILL_SIGNAL": "SIGTERM"}, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if "continue with: " in line]
    (run,) = run_dirs(tmp_path / "work" / "logs")
    found = json.loads((run / "tune.json").read_text())["override"]
    command = shlex.split(line.split("continue with: ")[1])
    assert command[:2] == ["python", "train.py"] and found in command and not any(a.startswith("tune") for a in command)
    resumed = train(tmp_path / "resumed", *command[2:])
    assert "Resuming from " in resumed.stderr + resumed.stdout


def test_ctrl_c_stops_a_search_at_once_and_leaves_nothing(tmp_path):
    """The run's own signal handling acts in callbacks, which the finders set aside while they search: Ctrl-C
    went unheard until the search ended (minutes for a long one). Now it stops the search, exit 130."""
    argv = [str(WARM.python_on_path() / "python"), str(REPO / "train.py"), "tune=lr", "tune.num_training=100000"]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=cli_env(**TINY), stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("logs/train/runs/*/.tune/.lr_find_*.ckpt")):  # the search has begun
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    assert time.monotonic() - sent < 10
    lines = (tmp_path / "stderr.txt").read_text().strip().splitlines()
    assert lines[-1] == "stopped by SIGINT during tune=lr: nothing was found or written"
    assert not [p for p in tmp_path.glob("logs/**/*") if p.is_file()]  # the run dir went, scratch checkpoint too


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["trainer=ddp", "trainer.accelerator=cpu"], "error: tune=lr: Lightning's finders run on one device"),
        (["tune.key=model.nope"], "error: tune.key=model.nope: no such key in this config"),
        (["ckpt_path=x.ckpt"], "error: tune with ckpt_path"),
        (["train=false"], "error: tune with train=false"),
    ],
    ids=["ddp", "no-such-key", "resume", "no-training"],
)
def test_what_the_finders_cannot_do_is_one_line_and_leaves_nothing(cli, tmp_path, args, line):
    proc = cli("train.py", *args, "tune=lr", env=TINY, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.ckpt"))


def test_a_sweep_of_finders_fails_each_job_with_the_reason(cli, tmp_path):
    proc = cli("train.py", "-m", "seed=1,2", "tune=lr", env=TINY, check=False)
    assert proc.returncode == 2
    for job in (0, 1):
        assert f"error: sweep job {job}: tune: Lightning's finders tune one run; run it without -m" in proc.stderr
    assert not list(tmp_path.rglob("tune.json"))


@pytest.mark.parametrize("mode", ["lr", "batch_size"])
def test_the_finders_give_the_weights_back_and_leave_only_their_report(make_cfg, tmp_path, mode):
    """In-process, on a user's net: Lightning trains the model while it searches, then restores it from its
    scratch checkpoint; the weights after are those before, bit for bit, and the checkpoint is gone."""
    cfg = make_cfg("profile=tiny", f"tune={mode}", *USER_NET)
    seed_run(cfg.seed)
    model, datamodule = instantiate(cfg.model), instantiate(cfg.data)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = tune.find(cfg, model, datamodule, tmp_path / "out")
    if mode == "lr":  # it did train: 100 steps, a loss that moved
        assert len(report["lr"]) == 100 and len(set(report["loss"])) > 50
    else:  # six trials of three steps, each batch size twice the last, all of which fit: bounded by max_trials
        assert report == {
            "mode": "batch_size",
            "key": "data.batch_size",
            "value": 64,
            "override": "data.batch_size=64",
            "stopped_by": "tune.max_trials=6: raise it to try larger batches",
        }
        assert tune.said(report, applied=False) == (  # what the run prints (the lr test reads it from the CLI)
            "tune=batch_size found 64 (stopped by tune.max_trials=6: raise it to try larger batches); "
            "train with: python train.py data.batch_size=64"
        )
        assert datamodule.batch_size == 64  # Lightning leaves the datamodule changed: apply builds it again
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == (["lr_find.png", "tune.json"] if mode == "lr" else ["tune.json"])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_module_that_hard_codes_its_lr_is_told_which_key_to_give_it(make_cfg, tmp_path):
    """tests/user_models.LitAutoEncoder, Lightning's README example as users copy it: Adam(lr=1e-3) written in its
    configure_optimizers. No config key holds its rate, and a key that is not its rate is caught after the search
    (the optimizer the search restores starts elsewhere), before anything is written."""
    lit = [
        "model=autoencoder",
        *(f"~model.{key}" for key in ("in_channels", "image_size", "latent", "lr")),
        "model._target_=user_models.LitAutoEncoder",
        "test=false",
    ]
    with pytest.raises(UserError, match=r"^tune=lr: none of model.optimizer.lr, model.lr, .* set tune.key="):
        tune.check(make_cfg("profile=tiny", "tune=lr", *lit))
    cfg = make_cfg("profile=tiny", "tune=lr", *lit, "tune.key=model.hidden")
    model, datamodule = instantiate(cfg.model), instantiate(cfg.data)
    with pytest.raises(UserError) as refused:
        tune.find(cfg, model, datamodule, tmp_path / "out")
    assert str(refused.value).startswith(
        "tune=lr: the optimizer starts at lr=0.001, not at model.hidden=128: the model does not read its rate from "
        "model.hidden; pass the rate to its configure_optimizers from a config key and name it with tune.key=<key>"
    )
    assert list((tmp_path / "out").iterdir()) == []  # no plot, no report, no scratch checkpoint


@pytest.mark.parametrize(
    "bad",
    [
        ["tune=lr", "tune.min_lr=-1"],
        ["tune=lr", "tune.min_lr=1", "tune.max_lr=0.1"],
        ["tune=lr", "tune.num_training=0"],
        ["tune=batch_size", "tune.max_trials=0"],
        ["tune=batch_size", "tune.init_val=0"],
        ["tune=batch_size", "tune.init_val=100", "tune.max_val=10"],  # "found 100", exit 0, before
        ["tune=lr", "tune.mode=foo"],
    ],
)
def test_bad_finder_settings_are_refused_before_anything_runs(make_cfg, bad):
    with pytest.raises(UserError, match=r"^tune\."):
        tune.check(make_cfg(*bad))
