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
