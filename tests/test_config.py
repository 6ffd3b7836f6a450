"""Every option of every config group composes and builds; bad keys fail by name."""

from pathlib import Path

import pytest
import torch
from conftest import REPO
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from project import build
from project.errors import UserError
from project.runs.dirs import unique_dir
from project.tasks.train import train

GROUPS = ["data", "model", "trainer", "precision", "callbacks", "logger", "paths", "debug", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((REPO / "conf" / g).glob("*.yaml"))]


def test_every_group_has_options():
    for group in GROUPS:
        assert any(g == group for g, _ in OPTIONS), f"conf/{group} has no option"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_builds(make_cfg, group, option):
    cfg = make_cfg(f"{group}={option}")
    if cfg.trainer.devices not in (1, "auto") and cfg.trainer.strategy != "dp" and torch.cuda.device_count() < 2:
        cfg.trainer.accelerator = "cpu"  # multi-device options build on CPU processes where GPUs are too few
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    datamodule = build.datamodule(cfg.data)
    model = build.model(cfg.model)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    callbacks, loggers = build.named(cfg.callbacks, "callbacks"), build.named(cfg.logger, "logger")
    needs_gpu = cfg.trainer.accelerator == "gpu" or cfg.trainer.strategy == "dp" or cfg.trainer.precision == "16-mixed"
    if needs_gpu and not torch.cuda.is_available():
        with pytest.raises(UserError, match="trainer.*(CUDA|GPU|gpu)"):
            build.trainer(cfg.trainer, callbacks, loggers)
        return
    trainer = build.trainer(cfg.trainer, callbacks, loggers)
    assert Path(trainer.default_root_dir) == Path(cfg.paths.output_dir)
    assert datamodule.batch_size >= 1


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
        train(make_cfg("+foo=1"))


def test_option_the_target_does_not_take_fails_by_name(make_cfg):
    with pytest.raises(UserError, match=r"trainer.max_epoch: .*did you mean 'max_epochs'"):
        train(make_cfg("+trainer.max_epoch=3"))
    with pytest.raises(UserError, match=r"model.net.chanels: .*did you mean 'channels'"):
        train(make_cfg("+model.net.chanels=[8]"))


def test_bad_value_is_one_line_user_error(make_cfg):
    with pytest.raises(UserError, match="data: ValueError: batch_size must be >= 1") as info:
        train(make_cfg("data.batch_size=0"))
    assert "\n" not in str(info.value)


def test_unique_dir_never_hands_out_the_same_dir_twice(tmp_path: Path):
    base = str(tmp_path / "runs" / "2026-01-01_00-00-00")
    first, second, third = unique_dir(base), unique_dir(base), unique_dir(base)
    assert len({first, second, third}) == 3
    assert all(Path(p).is_dir() for p in (first, second, third))
