"""Lightning's hook dispatch, trimmed (engine.callbacks.dispatch): a callback still gets every per-batch hook its
class overrides, on every batch; the hooks it leaves as no-ops are skipped; a profiler asked for still profiles."""

import lightning.pytorch as L
import pytest
from lightning.pytorch.profilers import SimpleProfiler
from user_models import LIT_AUTOENCODER

from engine import build
from engine.callbacks.dispatch import PER_BATCH_HOOKS, QuietProfiler
from project.tasks import train

TRAIN_BATCHES, VAL_BATCHES = 3, 2


class BatchCounter(L.Callback):
    """Written as a user writes a callback: two per-batch hooks, nothing else."""

    made: list["BatchCounter"] = []

    def __init__(self) -> None:
        self.train_batches, self.val_batches = 0, 0
        BatchCounter.made.append(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_batches += 1

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.val_batches += 1


class InheritedCounter(BatchCounter):
    """Its hooks come from its parent, not from itself: still called; and one it sets on itself."""

    def __init__(self) -> None:
        super().__init__()
        self.zero_grads = 0
        self.on_before_zero_grad = self._count_zero_grad

    def _count_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self.zero_grads += 1


# our classifier, and Lightning's README autoencoder as a user copies it (a LightningModule of another task, with no
# validation_step): the callbacks see the same hooks whatever the module
MODELS = {
    "ImageClassifier mlp": (["model=mlp"], VAL_BATCHES),
    "user's LitAutoEncoder": ([*LIT_AUTOENCODER], 0),
}


@pytest.mark.parametrize(("model", "val_batches"), MODELS.values(), ids=list(MODELS))
def test_a_callback_gets_every_per_batch_hook_it_overrides_and_is_skipped_for_the_rest(make_cfg, model, val_batches):
    BatchCounter.made.clear()
    cfg = make_cfg(
        *model,
        "trainer.accelerator=cpu",
        "trainer.max_epochs=2",
        f"+trainer.limit_train_batches={TRAIN_BATCHES}",
        f"+trainer.limit_val_batches={VAL_BATCHES}",
        "test=false",
        "+callbacks.counter._target_=test_dispatch.BatchCounter",
        "+callbacks.inherited._target_=test_dispatch.InheritedCounter",
    )
    train(cfg)
    assert len(BatchCounter.made) == 2
    assert BatchCounter.made[1].zero_grads == 2 * TRAIN_BATCHES  # a hook the instance set itself is kept
    for counter in BatchCounter.made:
        assert (counter.train_batches, counter.val_batches) == (2 * TRAIN_BATCHES, 2 * val_batches)
        assert counter.on_before_backward is None and counter.on_test_batch_end is None  # skipped by Lightning
        assert callable(counter.on_train_batch_end) and callable(counter.on_validation_batch_end)
    # the class itself is untouched: another instance, built elsewhere, has every hook
    assert all(callable(getattr(BatchCounter, hook)) for hook in PER_BATCH_HOOKS)


def test_lightnings_own_callbacks_keep_the_hooks_they_use(make_cfg):
    cfg = make_cfg("trainer.accelerator=cpu")
    callbacks = build.named(cfg.callbacks, "callbacks")
    trainer = build.trainer(cfg.trainer, callbacks, build.named(cfg.logger, "logger"))
    by_name = {type(c).__name__: c for c in trainer.callbacks}
    assert callable(by_name["BestCheckpoint"].on_train_batch_end)  # step-based checkpoints
    assert callable(by_name["ProgressBar"].on_train_batch_end)  # the bar's redraws
    assert by_name["EarlyStopping"].on_train_batch_end is None  # epochs only
    assert isinstance(trainer.profiler, QuietProfiler)


def test_a_profiler_asked_for_is_the_one_used_and_sees_the_callbacks(make_cfg, capsys, caplog):
    cfg = make_cfg("trainer.accelerator=cpu", "debug=profiler", "+trainer.limit_train_batches=2", "test=false")
    callbacks = build.named(cfg.callbacks, "callbacks")
    trainer = build.trainer(cfg.trainer, callbacks, [])
    assert isinstance(trainer.profiler, SimpleProfiler)
    train(cfg)
    report = capsys.readouterr().out + caplog.text  # Lightning prints the table at the end of fit
    assert "[Callback]ModelCheckpoint" in report and "on_train_batch_end" in report, report[:2000]


def test_self_log_does_not_move_its_result_to_where_it_already_is(make_cfg, monkeypatch, tmp_path):
    """engine.loggers.logged_values: Lightning moved each logged value's result object to the value's device on
    every self.log call (300-400 µs); now only when something in it is elsewhere. A user's module that logs every
    step logs the same values with and without the skip, and on one device never needs the move."""
    import json

    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric
    from torchmetrics import MeanMetric

    from engine.loggers import logged_values

    lightnings, moves = logged_values._lightnings_to, []

    def counted(result, *args, **kwargs):
        moves.append(args)
        return lightnings(result, *args, **kwargs)

    monkeypatch.setattr(logged_values, "_lightnings_to", counted)
    monkeypatch.setattr(_ResultMetric, "to", lightnings)  # Lightning's own until the Trainer is built

    def logged(out: str) -> dict:
        model, _ = MODELS["user's LitAutoEncoder"]
        overrides = ["trainer.accelerator=cpu", "trainer.max_epochs=2", "+trainer.limit_train_batches=4", "test=false"]
        train(make_cfg(*model, *overrides, f"paths.output_dir={tmp_path / out}"))
        return json.loads((tmp_path / out / "fit_metrics.json").read_text())

    skipped = logged("skipped")
    assert _ResultMetric.to is logged_values._to  # installed by build.trainer
    assert moves == [] and "train_loss" in skipped  # logged at every step, never moved
    monkeypatch.setattr(logged_values, "skip_needless_moves", lambda: None)
    monkeypatch.setattr(_ResultMetric, "to", counted)
    assert logged("moved") == skipped and moves  # Lightning's own moves: the same values

    moves.clear()
    tensor = _ResultMetric(_Metadata(fx="training_step", name="loss"), is_tensor=True)
    assert logged_values._to(tensor, torch.device("cpu")) is tensor and moves == []
    wrapped = _ResultMetric(_Metadata(fx="training_step", name="acc"), is_tensor=False)
    wrapped.update(MeanMetric(), 1)  # a logged metric: moved by Lightning when it is elsewhere
    assert logged_values._to(wrapped, torch.device("meta")) is wrapped and len(moves) == 1
    assert wrapped.value.device.type == "meta" and wrapped.value.mean_value.device.type == "meta"


def test_the_training_bar_takes_the_count_at_most_refresh_rate_times_a_second_and_at_an_epochs_end(monkeypatch):
    """Lightning's bar reads the logged values back at every training batch, whatever its refresh_rate (redraws a
    second): on millisecond steps, a cost the display never shows."""
    from lightning.pytorch.callbacks import RichProgressBar

    import engine.callbacks.progress as progress

    taken: list[int] = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, t, m, o, b, i: taken.append(i))
    monkeypatch.setattr(RichProgressBar, "total_train_batches", property(lambda self: 100))
    clock = iter([0.0, 0.01, 0.05, 0.1, 0.12, 0.35, 0.36, 0.37] + [0.38] * 92)
    monkeypatch.setattr(progress, "monotonic", lambda: next(clock))  # the bar's clock alone
    bar = progress.ProgressBar(refresh_rate=10)
    for batch_idx in range(100):
        bar.on_train_batch_end(None, None, None, None, batch_idx)
    assert taken == [0, 3, 5, 99]  # at 0 s, 0.1 s, 0.35 s (0.1 s apart at least), and the epoch's last batch


def test_with_speedups_off_the_trainer_is_lightnings_own(make_cfg):
    """`speedups=false`: no hook is set aside, Lightning's own profiler (none), and the NVML check as Lightning set it;
    the one switch for every shortcut of the engine (benchmarks/speedups.py says what each is worth)."""
    import os

    from lightning.pytorch.profilers import PassThroughProfiler

    from engine.launch.devices import NVML_CHECK

    os.environ[NVML_CHECK] = "1"  # as importing Lightning leaves it
    cfg = make_cfg("trainer.accelerator=cpu", "speedups=false")
    trainer = build.trainer(cfg.trainer, build.named(cfg.callbacks, "callbacks"), [], speedups=cfg.speedups)
    assert type(trainer.profiler) is PassThroughProfiler and os.environ[NVML_CHECK] == "1"
    assert all(callable(getattr(c, hook)) for c in trainer.callbacks for hook in PER_BATCH_HOOKS)
