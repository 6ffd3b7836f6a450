"""`tune=lr|batch_size`: Lightning's finders from the command line, on a user's net and on a LightningModule of
another task; `tune.apply=true` trains exactly as the printed override would."""

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import run_dirs

from project.errors import UserError
from project.tasks import tune

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
    assert not (run / "fit_metrics.json").exists() and not list((run / "checkpoints").iterdir())
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


def test_the_batch_size_finder_says_the_override(cli, tmp_path):
    proc = cli("train.py", *USER_NET, "tune=batch_size", env=TINY)
    (run,) = run_dirs(tmp_path / "logs")
    report = json.loads((run / "tune.json").read_text())
    assert report == {"mode": "batch_size", "key": "data.batch_size", "value": 64, "override": "data.batch_size=64"}
    assert "train with: python train.py data.batch_size=64" in proc.stdout + proc.stderr  # 2 doubled 5 times: bounded
    assert not list(tmp_path.rglob(".scale_batch_size*"))


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


def test_a_model_whose_lr_is_not_in_its_config_needs_tune_key(make_cfg):
    """A user's LightningModule that sets its lr in configure_optimizers: the finder can still run (without
    apply, tune.key only names the override), but the key must come from the user."""
    cfg = make_cfg("tune=lr", "model=autoencoder", "~model.lr")
    with pytest.raises(UserError, match=r"tune=lr: none of model.optimizer.lr, model.lr, .* set tune.key="):
        tune.config_key(cfg)


@pytest.mark.parametrize(
    "bad",
    [
        ["tune=lr", "tune.min_lr=-1"],
        ["tune=lr", "tune.min_lr=1", "tune.max_lr=0.1"],
        ["tune=lr", "tune.num_training=0"],
        ["tune=batch_size", "tune.max_trials=0"],
        ["tune=batch_size", "tune.init_val=0"],
        ["tune=lr", "tune.mode=foo"],
    ],
)
def test_bad_finder_settings_are_refused_before_anything_runs(make_cfg, bad):
    with pytest.raises(UserError, match=r"^tune\."):
        tune.check(make_cfg(*bad))
