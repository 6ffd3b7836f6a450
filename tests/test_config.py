"""Every option of every config group composes and builds; bad keys fail by name."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, write_idx
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from engine import build
from engine.config.schema import check_config
from engine.errors import UserError
from project.tasks import train

GROUPS = [
    "data",
    "model",
    "model/optimizer",
    "model/scheduler",
    "trainer",
    "precision",
    "callbacks",
    "logger",
    "paths",
    "debug",
    "experiment",
]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((REPO / "conf" / g).glob("*.yaml"))]
# What an option needs beside it (docs): torchvision's nets take colour images; a table's regressor and the text GPT
# go with their own data (experiment=diabetes and experiment=gpt_text pair them).
NEEDS = {
    "model=torchvision": ["data.channels=3"],
    "model=regressor": ["data=diabetes"],
    "data=diabetes": ["model=regressor"],
    "model=gpt": ["data=text"],
    "data=text": ["model=gpt"],
}


def test_every_group_has_options():
    for group in GROUPS:
        assert any(g == group for g, _ in OPTIONS), f"conf/{group} has no option"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_builds_and_trains(make_cfg, tmp_path, group, option):
    """Each option alone on top of the defaults: it composes, builds, and (where one CPU process can run it)
    fits and tests a few batches for real, loggers and checkpoints included."""
    needs = NEEDS.get(f"{group}={option}", [])
    cfg = make_cfg(f"{group}={option}", "profile=tiny", "trainer.max_epochs=1", "data.batch_size=16", *needs)
    if "MNISTDataModule" in cfg.data._target_:
        write_idx(Path(cfg.paths.data_dir), cfg.data.dataset, n_train=cfg.data.val_size + 100)
    if cfg.data._target_.endswith("ImageFolderDataModule"):  # your own images: here PNG files of the digits
        from project.data.digit_images import write_digit_images

        write_digit_images(tmp_path / "images", per_class=20)
        cfg.data.root = str(tmp_path / "images")
    processes = cfg.trainer.devices not in (1, "auto") and cfg.trainer.strategy != "dp"
    if processes and torch.cuda.device_count() < 2:
        cfg.trainer.accelerator = "cpu"  # multi-device options build on CPU processes where GPUs are too few
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    model = instantiate(cfg.model)
    if "channels" in cfg.data:  # images: a classifier's ten scores, an autoencoder's image back
        x = torch.zeros(2, cfg.data.channels, 28, 28)
        assert model(x).shape == ((2, 10) if hasattr(model, "num_classes") else x.shape)
    callbacks, loggers = build.named(cfg.callbacks, "callbacks"), build.named(cfg.logger, "logger")
    needs_gpu = cfg.trainer.accelerator == "gpu" or cfg.trainer.strategy == "dp" or cfg.trainer.precision == "16-mixed"
    if needs_gpu and not torch.cuda.is_available():
        with pytest.raises(UserError, match="trainer.*(CUDA|GPU|gpu)"):
            build.trainer(cfg.trainer, callbacks, loggers)
        return
    trainer = build.trainer(cfg.trainer, callbacks, loggers)
    assert Path(trainer.default_root_dir) == Path(cfg.paths.output_dir)
    if processes:
        return  # several processes: the CLI tests run these (tests/test_cli.py, test_fsdp.py, test_sweeps.py)
    train(cfg)
    metrics = json.loads((tmp_path / "out" / "test_metrics.json").read_text())
    assert 0.0 <= metrics.get("test/acc", 0.0) <= 1.0
    assert metrics.get("test/loss", metrics.get("test/mse")) > 0
    checkpointed = list((tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks) and not trainer.fast_dev_run
    assert bool(checkpointed) == checkpointing


def test_an_option_without_what_it_needs_stops_in_one_line(make_cfg):
    with pytest.raises(UserError, match=r"does not take the data's images \(1 channels, 28x28\).*data.channels"):
        train(make_cfg("model=torchvision"))


def test_eval_config_composes(make_cfg):
    cfg = make_cfg("ckpt_path=x.ckpt", name="eval")
    assert cfg.data is None  # by default the data config comes from the checkpoint
    cfg = make_cfg("ckpt_path=x.ckpt", "data=mnist", name="eval")
    assert cfg.data.dataset == "MNIST"


def test_typo_in_top_level_key_fails_at_compose(make_cfg):
    with pytest.raises(ConfigCompositionException, match="sed"):
        make_cfg("sed=1")


def test_added_unknown_key_fails_before_training(make_cfg):
    with pytest.raises(UserError, match="foo: not a known key"):
        check_config(make_cfg("+foo=1"))  # engine.entry.run checks it before the task imports torch


def test_option_the_target_does_not_take_fails_by_name(make_cfg):
    with pytest.raises(UserError, match=r"trainer.max_epoch: .*did you mean 'max_epochs'"):
        train(make_cfg("+trainer.max_epoch=3"))
    with pytest.raises(UserError, match=r"model.net.chanels: .*did you mean 'channels'"):
        train(make_cfg("+model.net.chanels=[8]"))


def test_bad_value_is_one_line_user_error(make_cfg):
    """The task builds with hydra.utils.instantiate; engine.entry.run says what the target refused in one line."""
    with pytest.raises(InstantiationException) as info:
        train(make_cfg("data.batch_size=0"))
    assert str(build.one_line(info.value)).startswith("data: ValueError: batch_size must be >= 1")
    assert "\n" not in str(build.one_line(info.value))


def test_every_config_file_starts_with_a_one_line_summary():
    """`python train.py --help` shows it beside each option (engine.help)."""
    from engine.help import summary

    for path in sorted((REPO / "conf").rglob("*.yaml")):
        line = summary(path)
        assert 0 < len(line) <= 90, f"{path.relative_to(REPO)}: first line {line!r}"


@pytest.fixture
def with_local(tmp_path):
    """The entry points and conf/ in a folder of their own, with a conf/local/default.yaml made from the example."""
    import shutil

    for name in ("train.py", "eval.py", "predict.py", "export.py"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    local = tmp_path / "conf" / "local" / "default.yaml"
    example = (tmp_path / "conf" / "local" / "example.yaml").read_text()
    local.write_text(example.replace("data_dir: ${paths.root_dir}/data", "data_dir: /scratch/me/data"))
    return tmp_path


def _composed(folder, *args):
    import subprocess
    import sys

    from conftest import cli_env

    return subprocess.run(
        [sys.executable, *args], cwd=folder, env=cli_env(), capture_output=True, text=True, timeout=120
    )


def test_this_machines_own_settings_reach_every_entry_point_after_an_experiment(with_local):
    for args in (
        ["train.py"],
        ["train.py", "experiment=diabetes", "debug=fdr"],
        ["eval.py", "ckpt_path=x.ckpt"],
        ["predict.py", "ckpt_path=x.ckpt"],
        ["export.py", "ckpt_path=x.ckpt"],
    ):
        proc = _composed(with_local, *args, "--cfg", "job", "--package", "paths")
        assert proc.returncode == 0, proc.stderr
        assert "data_dir: /scratch/me/data" in proc.stdout.splitlines(), (args, proc.stdout)
    proc = _composed(with_local, "train.py", "paths.data_dir=/given", "--cfg", "job", "--package", "paths")
    assert "data_dir: /given" in proc.stdout.splitlines()  # the command line still decides
    assert "local" not in _composed(with_local, "train.py", "--help").stdout  # not a group a user picks


def test_a_key_in_this_machines_settings_that_no_config_declares_is_one_line(with_local):
    local = with_local / "conf" / "local" / "default.yaml"
    example = local.read_text()
    for added, named in (("seeds: 3\n", "local/default"), ("trainer:\n  max_epoch: 3\n", "did you mean 'max_epochs'")):
        local.write_text(example + added)
        proc = _composed(with_local, "train.py")
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert named in line and added.split(":")[-2].strip() in line, line


def test_git_ignores_this_machines_own_settings_and_keeps_the_example():
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", "-q", "conf/local/default.yaml"], cwd=REPO)
    kept = subprocess.run(["git", "check-ignore", "-q", "conf/local/example.yaml"], cwd=REPO)
    assert ignored.returncode == 0 and kept.returncode == 1
