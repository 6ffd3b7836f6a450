"""strategy=pipe: one process, the net's stages on several devices, micro-batches pipelined.

On CPU every stage sits on `cpu` (in its own worker thread), which runs the same schedule and the same
gradient flow as on GPUs; the tests compare it with one device, step by step.
"""

import json
from functools import partial

import lightning.pytorch as L
import pytest
import torch
from conftest import run_dirs

from project.data.digits import DigitsDataModule
from project.models.classifier import ImageClassifier
from project.models.mlp import MLP
from project.strategies.pipe import PipeStrategy, clock


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(strategy, devices: int, batch_size: int = 50, max_epochs: int = 2):
    L.seed_everything(0)
    net = MLP(hidden=(64, 64, 32), dropout=0.0)
    model = ImageClassifier(net=net, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
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
    trainer.fit(model, DigitsDataModule(batch_size=batch_size))
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


class ThreadRecorder(torch.nn.Module):
    """A layer that notes which thread ran it."""

    def __init__(self, inner: torch.nn.Module, seen: list[str]) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x):
        import threading

        self.seen.append(threading.current_thread().name)
        return self.inner(x)


def test_the_stages_are_balanced_by_parameters_and_each_runs_in_its_own_thread():
    strategy = PipeStrategy(micro_batches=2)
    fit(strategy, 2, max_epochs=1)
    assert [len(stage) for stage in strategy.stage_modules] == [2, 6]  # Linear(784, 64) outweighs the rest

    first, second = [], []
    net = torch.nn.Sequential(
        torch.nn.Flatten(),
        ThreadRecorder(torch.nn.Linear(784, 32), first),
        ThreadRecorder(torch.nn.Linear(32, 10), second),
    )
    model = ImageClassifier(net=net, optimizer=partial(torch.optim.SGD, lr=0.1))
    trainer = L.Trainer(
        strategy=PipeStrategy(micro_batches=2, balance=[2, 1]),
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
    assert set(first) == {"pipe-stage0_0"} and set(second) == {"pipe-stage1_0"} and len(first) == 2


def test_a_net_that_is_not_a_sequence_of_blocks_is_refused_by_name():
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(784, 10)

        def forward(self, x):
            return self.a(x.flatten(1))

    model = ImageClassifier(net=Branchy(), optimizer=partial(torch.optim.SGD, lr=0.1))
    trainer = L.Trainer(strategy=PipeStrategy(), accelerator="cpu", devices=2, logger=False, max_steps=1)
    with pytest.raises(Exception, match="Branchy cannot be cut into stages"):
        trainer.fit(model, DigitsDataModule())


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
