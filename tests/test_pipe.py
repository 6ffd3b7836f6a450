"""strategy=pipe: one process, the net's stages on several devices, micro-batches pipelined.

On CPU every stage sits on `cpu` (in its own worker thread), which runs the same schedule and the same
gradient flow as on GPUs; the tests compare it with one device, step by step.
"""

import json
import threading
from functools import partial

import lightning.pytorch as L
import pytest
import torch
import torchvision
from conftest import run_dirs
from probes import StepLosses
from user_models import Gated, GatedNet, ResidualNet, TutorialCNN

from engine.errors import UserError
from engine.strategies.pipe import PipeStrategy, clock
from project.data.digits import DigitsDataModule
from project.models.classifier import ImageClassifier
from project.models.mlp import MLP


def fit(strategy, devices: int, batch_size: int = 50, max_epochs: int = 2, net=None, channels: int = 1, lr=0.1):
    L.seed_everything(0)
    net = net() if net is not None else MLP(hidden=(64, 64, 32), dropout=0.0)
    model = ImageClassifier(net=net, optimizer=partial(torch.optim.SGD, lr=lr, momentum=0.9))
    losses = StepLosses()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        limit_train_batches=6,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(model, DigitsDataModule(batch_size=batch_size, channels=channels))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return losses.losses, model.net.state_dict(), metrics, model


def test_the_clock_fills_and_drains_the_pipeline():
    assert clock(3, 2) == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    assert clock(1, 3) == [[(0, 0)], [(1, 0)], [(2, 0)]]  # one micro-batch: the plain model-parallel split


@pytest.fixture(scope="module")
def single():
    return fit("auto", 1)


@pytest.mark.parametrize(
    ("micro_batches", "split_size", "stages"),
    [(1, None, 2), (2, None, 2), (4, None, 2), (3, None, 2), (4, None, 3), (1, 16, 2)],
    ids=["M=1", "M=2", "M=4", "M=3 (does not divide 50)", "3 stages", "split_size=16"],
)
def test_pipe_takes_the_same_steps_as_one_device(single, micro_batches, split_size, stages):
    single_losses, single_weights, single_metrics, _ = single
    strategy = PipeStrategy(micro_batches=micro_batches, split_size=split_size)
    losses, weights, metrics, model = fit(strategy, stages)
    assert len(losses) == len(single_losses) == 12
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_losses), atol=1e-5, rtol=0)
    assert weights.keys() == single_weights.keys()  # checkpoints of pipe and of one device are interchangeable
    for name, value in single_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0)
    for key in ("train/acc", "val/acc", "val/loss", "val/acc_best"):
        assert metrics[key] == pytest.approx(single_metrics[key], abs=1e-5), key
    assert "forward" not in vars(model.net)  # the pipelined forward is gone after the run


USER_NETS = {
    # BatchNorm: statistics per micro-batch unless M=1, where the stages update them exactly as one device does
    "tutorial_cnn split_points=[conv2] M=1": (TutorialCNN, 1, ["conv2"], 1),
    # dropout drawn in the stages, in the net's order when M=1
    "residual (dropout) M=1": (lambda: ResidualNet(dropout=0.3), 1, None, 1),
    "residual auto cut M=4": (ResidualNet, 1, None, 4),
    "torchvision resnet18 split_points=[layer3] M=1": (
        lambda: torchvision.models.resnet18(num_classes=10),
        3,
        ["layer3"],
        1,
    ),
}


@pytest.mark.parametrize("name", USER_NETS)
def test_nets_written_as_users_write_them_take_the_same_steps_as_one_device(name):
    make, channels, split_points, micro_batches = USER_NETS[name]
    same = {"batch_size": 16, "max_epochs": 1, "net": make, "channels": channels, "lr": 0.01}
    single_losses, single_weights, single_metrics, _ = fit("auto", 1, **same)
    # the stages' threads with as many intra-op threads as the single device had: a convolution sums in another
    # order on another thread count, and ResNet's 6 steps grow that rounding into 1e-2
    threads = torch.get_num_threads()
    strategy = PipeStrategy(micro_batches=micro_batches, split_points=split_points, threads_per_stage=threads)
    losses, weights, metrics, model = fit(strategy, 2, **same)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_losses), atol=1e-5, rtol=0)
    assert weights.keys() == single_weights.keys()  # BatchNorm's running statistics included
    for key, value in single_weights.items():
        torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    assert metrics["val/acc"] == pytest.approx(single_metrics["val/acc"], abs=1e-6)
    if split_points:
        assert strategy.plan.names == split_points


def test_the_stages_are_balanced_by_parameters_and_each_runs_in_its_own_thread():
    strategy = PipeStrategy(micro_batches=2)
    fit(strategy, 2, max_epochs=1)
    assert strategy.plan.names == ["layers.2"]  # Flatten, Linear(784, 64) | the other 6 blocks: they weigh less

    seen: dict[str, set[str]] = {"first": set(), "second": set()}
    net = TutorialCNN()
    net.conv1.register_forward_hook(lambda *_: seen["first"].add(threading.current_thread().name))
    net.fc3.register_forward_hook(lambda *_: seen["second"].add(threading.current_thread().name))
    model = ImageClassifier(net=net, optimizer=partial(torch.optim.SGD, lr=0.1))
    trainer = L.Trainer(
        strategy=PipeStrategy(micro_batches=2, split_points=["fc1"]),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DigitsDataModule(batch_size=8))
    assert seen == {"first": {"pipe-stage0_0"}, "second": {"pipe-stage1_0"}}


def _trainer(**kwargs) -> L.Trainer:
    # no checkpoints: Lightning would write them under the working directory (the repository)
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        max_steps=1,
        enable_progress_bar=False,
        **kwargs,
    )


def test_a_net_torch_fx_cannot_trace_is_refused_in_one_line_and_leaves_keep_it_whole():
    model = ImageClassifier(net=Gated(), optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(UserError, match="cannot cut Gated into stages: torch.fx cannot trace Gated.forward at .*"):
        _trainer(strategy=PipeStrategy()).fit(model, DigitsDataModule())
    model = ImageClassifier(net=GatedNet(), optimizer=partial(torch.optim.SGD, lr=0.1))
    _trainer(strategy=PipeStrategy(leaves=["Gated"]), limit_val_batches=0).fit(model, DigitsDataModule(batch_size=8))


def test_a_net_that_changes_its_own_buffer_in_forward_is_refused_and_left_as_it_was():
    """`self.steps += 1` in forward ran once, on the real buffer, while the net was traced, and never again: the
    stages run the trace. The count stayed at 1 under pipe and pipeline, without a word."""
    from user_models import CountsItsSteps

    from engine.strategies import split

    net = CountsItsSteps()
    with pytest.raises(UserError, match=r"its forward changes its own buffer 'steps' in Python code of its own"):
        split.trace(net, training=True)
    assert int(net.steps) == 0  # put back as it was
    split.trace(net, training=False)  # in eval mode it changes nothing: traced as it is
    model = ImageClassifier(net=CountsItsSteps(), optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(UserError, match="cannot cut CountsItsSteps into stages: its forward changes"):
        _trainer(strategy=PipeStrategy(), limit_val_batches=0).fit(model, DigitsDataModule(batch_size=8))


def test_a_training_step_that_never_calls_the_net_is_refused():
    class Direct(ImageClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.criterion(self.net.fc3(self.net.fc2(torch.zeros(len(x), 120))), y).mean()

    model = Direct(net=TutorialCNN(), optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(UserError, match=r"training_step never called the net's forward.*self\(x\)"):
        _trainer(strategy=PipeStrategy(), limit_val_batches=0).fit(model, DigitsDataModule(batch_size=8))


@pytest.mark.slow
def test_trainer_pipe_trains_checkpoints_and_its_checkpoint_evaluates_on_one_device(cli, tmp_path):
    cli(
        "train.py",
        "trainer=pipe",
        "trainer.accelerator=cpu",
        "model=mlp",
        "trainer.strategy.micro_batches=3",
        env={"PROJECT_PROFILE": "tiny"},
    )
    (run,) = run_dirs(tmp_path / "logs")
    fit_metrics = json.loads((run / "fit_metrics.json").read_text())
    assert 0.0 < fit_metrics["val/acc"] <= 1.0
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    cli("eval.py", f"ckpt_path={best}", env={"PROJECT_PROFILE": "tiny"})  # one device: the keys are the same
    (evaluated,) = run_dirs(tmp_path / "logs", task="eval")
    tested = json.loads((run / "test_metrics.json").read_text())["test/acc"]
    assert json.loads((evaluated / "test_metrics.json").read_text())["test/acc"] == pytest.approx(tested, abs=1e-6)
