"""Each network, and each model config trained through `train()` on the default data."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hydra.utils import instantiate

from project.models.lenet import LeNet
from project.models.mlp import MLP
from project.models.resnet import ResNet18
from project.tasks import train

MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("net", [LeNet(), MLP(), ResNet18()], ids=["lenet", "mlp", "resnet18"])
def test_net_maps_digits_to_ten_logits_and_learns(net):
    x, y = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    assert net(x).shape == (8, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# What a model takes: torchvision's nets colour images (the digits in three channels); the regressor a table,
# the GPT text (each example's experiment pairs them).
WITH = {"torchvision": ["data.channels=3"], "regressor": ["data=diabetes"], "gpt": ["data=text"]}


@pytest.mark.parametrize("model", MODELS)
def test_model_fast_dev_run_on_default_data(make_cfg, tmp_path, model):
    train(make_cfg(f"model={model}", "debug=fdr", "trainer.accelerator=cpu", *WITH.get(model, [])))
    metrics = json.loads((tmp_path / "out" / "test_metrics.json").read_text())
    assert 0.0 <= metrics.get("test/acc", 0.0) <= 1.0
    assert metrics.get("test/loss", metrics.get("test/mse")) > 0


def _test_loss(make_cfg, tmp_path: Path, seed: int) -> float:
    train(make_cfg(f"seed={seed}", "model=mlp", "debug=limit", "trainer.max_epochs=1", "callbacks=none", "logger=none"))
    return json.loads((tmp_path / "out" / "test_metrics.json").read_text())["test/loss"]


def test_seed_zero_is_a_seed(make_cfg, tmp_path):
    first, again = _test_loss(make_cfg, tmp_path, 0), _test_loss(make_cfg, tmp_path, 0)
    other = _test_loss(make_cfg, tmp_path, 1)
    assert first == again
    assert first != other


@pytest.mark.parametrize("model", MODELS)
def test_a_checkpoint_of_each_model_rebuilds_through_the_safe_loader(make_cfg, tmp_path, model):
    from omegaconf import OmegaConf

    from engine.runs.full_model import load_model

    # as a run would be: torchvision's nets take three channels (a checkpoint whose data does not fit is refused)
    cfg = make_cfg(f"model={model}", *WITH.get(model, []))
    module = instantiate(cfg.model)
    path = tmp_path / "model.ckpt"
    torch.save({"run_config": OmegaConf.to_container(cfg, resolve=True), "state_dict": module.state_dict()}, path)
    loaded, _ = load_model(str(path))
    assert type(loaded) is type(module) and type(getattr(loaded, "net", None)) is type(getattr(module, "net", None))
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
