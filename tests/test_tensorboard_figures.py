"""The figures and the graph the TensorBoard callback (engine.callbacks.tensorboard) draws: when, from what, in a
thread that leaves training alone, for the template's classifier and for nets written as users write them. The
server that shows them: tests/test_tensorboard.py."""

from pathlib import Path

import pytest
from conftest import run_dirs

pytestmark = pytest.mark.slow


def test_figures_are_drawn_with_no_torch_op_in_their_thread(make_cfg, monkeypatch):
    """A torch op in a second thread starts a second OpenMP thread team; with more OpenMP threads than cores,
    libgomp stops spinning, and every later training step of the process ran up to 3x slower on 2 cores. The
    drawing thread gets numpy arrays only; a torch function mode in that thread records any torch call."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.overrides import TorchFunctionMode

    import engine.callbacks.tensorboard as insights
    from project.tasks import train

    calls: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def painter(workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix, initializer=Record().__enter__)

    monkeypatch.setattr(insights, "ThreadPoolExecutor", painter)
    cfg = make_cfg("profile=tiny", "model=mlp", "test=false", "trainer.max_epochs=1")
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    drawn = EventAccumulator(str(events)).Reload().Tags()["images"]
    assert {"val/samples", "val/confusion_matrix"} <= set(drawn)
    assert calls == []


def test_an_image_summary_is_the_array_as_a_lossless_png():
    """The figures are written pre-encoded (PNG at the fast level, no resize): the pixels TensorBoard shows are
    exactly the ones drawn."""
    import io

    import numpy as np
    from PIL import Image

    from engine.loggers import figures

    drawn = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    (value,) = figures.image_summary("val/samples", drawn).value
    assert (value.tag, value.image.height, value.image.width, value.image.colorspace) == ("val/samples", 40, 60, 3)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string))), drawn)


@pytest.mark.parametrize("interval", [3600, 0])
def test_figures_come_at_most_every_min_interval_and_always_for_the_last_epoch(make_cfg, interval):
    """TensorBoard shows 10 images of a tag (it samples the rest), and drawing them cost a 0.2 s epoch about 18 ms
    (benchmarks/step_loop.py): figures come once `min_interval_s` (10 s) has passed since the fit started or since
    the figures before, and the last epoch's always (a short fit gets only those); `min_interval_s=0` draws every
    epoch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks import train

    interval_s = f"callbacks.tensorboard.min_interval_s={interval}"
    cfg = make_cfg("profile=tiny", "model=mlp", "test=false", "trainer.max_epochs=3", interval_s)
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    run = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    epochs = [e.step for e in run.Scalars("val/acc")]
    assert len(epochs) == 3
    for tag in ("val/samples", "val/confusion_matrix"):
        drawn = [e.step for e in run.Images(tag)]
        assert drawn == (epochs if interval == 0 else [epochs[-1]]), tag


def test_a_fit_stopped_by_a_signal_still_gets_its_last_figures(cli, tmp_path):
    """A fit shorter than min_interval_s holds its figures back for its end; one that a signal stops (or an error
    ends) skips Lightning's on_train_end, and drew none. The held-back figures are drawn as it stops."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stopped = cli(
        "train.py", "model=mlp", "trainer.max_epochs=2", "+callbacks.probe._target_=probes.SignalAt",
        env={"PROJECT_PROFILE": "tiny", "SIGNAL_AT": "last_validation"}, check=False,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (run,) = run_dirs(tmp_path / "logs")
    (events,) = run.glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    last = found.Scalars("val/acc")[-1].step
    for tag in ("val/samples", "val/confusion_matrix"):
        assert [e.step for e in found.Images(tag)] == [last], tag


def test_an_evaluation_draws_the_test_sets_figures_for_a_users_net(make_cfg, tmp_path):
    """eval.py, like the test after a fit, draws the test set's sample grid and confusion matrix (from what the
    classifier's test_step returns) at the step of its test scalars; here with a net written as users write them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks import evaluate, train

    user_net = ("~model.net", "+model.net._target_=user_models.TutorialCNN")
    train(make_cfg("profile=tiny", *user_net, "logger=none", "test=false"))
    (best,) = (tmp_path / "out" / "checkpoints").glob("epoch_*.ckpt")
    out = tmp_path / "evaluated"
    ckpt = (f"ckpt_path={best}", "trusted_packages=[user_models]")
    evaluate(make_cfg("profile=tiny", *ckpt, f"paths.output_dir={out}", name="eval"))
    (events,) = out.glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    (tested,) = [e.step for e in found.Scalars("test/acc")]
    assert {tag: [e.step for e in found.Images(tag)] for tag in found.Tags()["images"]} == {
        "test/samples": [tested],
        "test/confusion_matrix": [tested],
    }


def test_a_confusion_matrix_sized_by_the_labels_grows_with_them(tmp_path):
    """A module without `num_classes` gets a matrix as large as the largest label seen: a later batch with a larger
    label than the first ones failed the test (tensors of 8 and 10 classes added); a module that returns nothing
    gets no figure."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from engine.callbacks.tensorboard import TensorBoardInsights

    class Labels(L.LightningModule):  # no num_classes; predicts the label it is given
        def __init__(self, returns: bool) -> None:
            super().__init__()
            self.returns, self.layer = returns, nn.Linear(1, 1)

        def test_step(self, batch, batch_idx):
            x, y = batch
            return {"preds": y, "target": y} if self.returns else None

    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # batches of 4: largest 3, then 7, then 9
    data = DataLoader(TensorDataset(torch.zeros(10, 1, 1, 1), labels), batch_size=4)
    for returns in (True, False):
        logger = TensorBoardLogger(str(tmp_path), name=str(returns), version="")
        trainer = L.Trainer(
            accelerator="cpu", logger=logger, callbacks=[TensorBoardInsights(images=False)], enable_progress_bar=False
        )
        trainer.test(Labels(returns), data)
        (events,) = (tmp_path / str(returns)).glob("events.out.tfevents.*")
        images = EventAccumulator(str(events), size_guidance={"images": 0}).Reload().Tags()["images"]
        assert images == (["test/confusion_matrix"] if returns else [])


def test_the_graph_is_traced_once_without_torchs_trace_check(make_cfg, monkeypatch):
    """SummaryWriter.add_graph traces with torch.jit.trace's check_trace: two more traces, compared, about twice
    the time of tracing once at every run's first step (benchmarks/graph.py). The graph is only drawn, so it is
    traced once; TensorBoard still gets it, for a user's net too."""
    import torch.jit._trace as tracing
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks import train

    checks: list[str] = []
    check = tracing._check_trace
    monkeypatch.setattr(tracing, "_check_trace", lambda *a, **k: (checks.append("check"), check(*a, **k))[1])
    user_net = ("~model.net", "+model.net._target_=user_models.TutorialCNN")
    cfg = make_cfg("profile=tiny", *user_net, "test=false", "trainer.max_epochs=1")
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events)).Reload()
    assert found.Tags()["graph"] and any(node.op == "aten::_convolution" for node in found.Graph().node)
    assert checks == []


def test_drawing_the_graph_leaves_each_submodules_mode_as_it_was():
    """The graph is traced in eval mode; afterwards every submodule is back in its own mode: a part the user keeps
    in eval (a frozen BatchNorm backbone) stayed in train mode after the graph before, and BatchNorm's batch count
    is not moved by the trace."""
    import torch
    from torch import nn

    from engine.callbacks.tensorboard import _graph

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(1352, 10))
    net[1].eval()  # frozen by the user
    _graph(net, torch.zeros(2, 1, 28, 28))
    assert [m.training for m in net.modules()] == [True, True, False, True, True, True]
    assert int(net[2].num_batches_tracked) == 0  # traced in eval mode
