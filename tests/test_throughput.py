"""The FLOP count of `callbacks=[default,throughput]` (engine.callbacks.throughput) on users' LightningModules, in
this process: a module's own `flops_per_batch` is kept, a failing first batch leaves no counter behind, and what
cannot be counted (dp, pipe: threads) is refused in one line. The count itself, in TensorBoard, is checked on a
user's CNN through the CLI in tests/test_averaging.py; on a GPU, with MFU, in tests/test_gpu.py."""

import lightning.pytorch as L
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from user_models import KeepsItsNet, LitAutoEncoder, TutorialCNN

from engine.callbacks.throughput import ThroughputMonitor
from engine.errors import UserError


class Digits(L.LightningDataModule):
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 1, 28, 28), torch.zeros(64, dtype=torch.long))
        return torch.utils.data.DataLoader(data, batch_size=16)


def tutorial_cnn_flops(batch: int, backward: bool = True) -> int:
    """One training batch of the user's CNN, counted apart from any run: Lightning's measure_flops over forward,
    loss and backward (the input needs no gradient, as in training); its forward alone with `backward=False`."""
    from lightning.fabric.utilities.throughput import measure_flops

    net, x, y = TutorialCNN(), torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    loss = (lambda logits: torch.nn.functional.cross_entropy(logits, y)) if backward else None
    return measure_flops(net, lambda: net(x), loss)


def fit(module: L.LightningModule, monitor: ThroughputMonitor, **trainer: object) -> None:
    options = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False)
    options.update(enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(callbacks=[monitor], **{**options, **trainer}).fit(module, datamodule=Digits())


def test_the_first_batch_is_counted_once_and_a_modules_own_count_is_kept(caplog):
    counted = LitAutoEncoder()
    with caplog.at_level("INFO", logger="engine.callbacks.throughput"):
        fit(counted, ThroughputMonitor())
    assert "Throughput: 4 training batches, fewer than callbacks.throughput.window_size=10: no rates were logged" in (
        caplog.text
    )
    # encoder and decoder: 784-64-3-64-784, forward 2*16*(784*64 + 64*3 + 3*64 + 64*784) FLOPs, backward twice that
    # but for the first layer's input gradient (the images need none)
    forward = 2 * 16 * (784 * 64 + 64 * 3 + 3 * 64 + 64 * 784)
    assert counted.flops_per_batch == 3 * forward - 2 * 16 * 784 * 64

    own = LitAutoEncoder()
    own.flops_per_batch = 12345
    monitor = ThroughputMonitor()
    fit(own, monitor)
    assert own.flops_per_batch == 12345 and monitor._counter is None


def test_a_peak_given_in_the_config_gives_mfu_where_lightning_knows_none(tmp_path):
    """On CPU Lightning knows no peak: `peak_flops` is the device's, MFU the FLOP rate over it."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    peak = 2.5e9  # the lowest a device may claim is 1e9; not a whole number of GFLOP/s
    logger = CSVLogger(tmp_path, name="t")
    fit(LitAutoEncoder(), ThroughputMonitor(window_size=2, peak_flops=peak), logger=logger, log_every_n_steps=1)
    (path,) = tmp_path.glob("t/*/metrics.csv")
    rows = [row for row in csv.DictReader(path.open()) if row.get("train/device/mfu")]
    assert rows
    for row in rows:
        assert float(row["train/device/mfu"]) == pytest.approx(float(row["train/device/flops_per_sec"]) / peak)


@pytest.mark.parametrize("peak", [0, -1.0, 1, 1e8, "fast", True, float("inf"), float("nan")])
def test_a_peak_that_is_not_a_devices_number_is_refused(peak):
    with pytest.raises(UserError, match=r"^callbacks.throughput.peak_flops="):
        ThroughputMonitor(peak_flops=peak)


class Validated(KeepsItsNet):
    """A user's module with a validation step, as most have."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    test_step = validation_step


def test_each_stage_counts_its_own_batches_validation_and_test_their_forward_alone():
    """Lightning used the training batch's count (forward and backward) for validation and test batches too."""
    from lightning.pytorch.trainer.states import RunningStage

    monitor, module = ThroughputMonitor(), Validated(TutorialCNN())
    trainer = L.Trainer(
        callbacks=[monitor], accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, num_sanity_val_steps=1,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=Digits().train_dataloader(), val_dataloaders=Digits().train_dataloader())
    trainer.test(module, dataloaders=Digits().train_dataloader())
    assert monitor._counted == {
        RunningStage.TRAINING: tutorial_cnn_flops(16),
        RunningStage.VALIDATING: tutorial_cnn_flops(16, backward=False),
        RunningStage.TESTING: tutorial_cnn_flops(16, backward=False),
    }
    assert module.flops_per_batch == tutorial_cnn_flops(16, backward=False)  # the stage that ran last: test


class SetsItsOwnInSetup(Validated):
    """Lightning's documented way: the count set in the module's own setup (which runs after the callbacks')."""

    def setup(self, stage):
        self.flops_per_batch = 777


def test_a_count_the_module_sets_in_its_setup_is_kept_and_not_refused_where_threads_compute():
    import engine.strategies  # noqa: F401  registers pipe

    for strategy in ("auto", "pipe"):
        module, monitor = SetsItsOwnInSetup(TutorialCNN()), ThroughputMonitor()
        fit(module, monitor, strategy=strategy, devices=1)
        assert module.flops_per_batch == 777 and monitor._counted == {}


def test_an_evaluation_where_threads_compute_is_refused_too():
    import engine.strategies  # noqa: F401  registers pipe

    trainer = L.Trainer(callbacks=[ThroughputMonitor()], accelerator="cpu", strategy="pipe", devices=1, logger=False)
    with pytest.raises(UserError, match=r"^callbacks.throughput.count_flops: PipeStrategy computes in threads"):
        trainer.test(Validated(TutorialCNN()), dataloaders=Digits().train_dataloader())


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_nets_window_starts_after_the_batch_that_compiles(compiled):
    """torch does not compile under a FLOP counter: the counted first batch runs eager, the second compiles. Its
    time (seconds) stays out of the rates: the window starts after it."""
    from lightning.pytorch.trainer.states import RunningStage

    module, monitor = KeepsItsNet(TutorialCNN()), ThroughputMonitor()
    if compiled:
        module.net.compile(backend="aot_eager")
    fit(module, monitor)
    assert monitor._counted[RunningStage.TRAINING] == tutorial_cnn_flops(16)
    assert list(monitor._throughputs[RunningStage.TRAINING]._batches) == ([2, 3, 4] if compiled else [1, 2, 3, 4])


class FailsFirstStep(LitAutoEncoder):
    def training_step(self, batch, batch_idx):
        self.encoder(batch[0].flatten(1))  # counted work, then the user's bug
        raise RuntimeError("a bug in the first step")


def test_a_first_step_that_fails_leaves_no_flop_counter_behind():
    with pytest.raises(RuntimeError, match="a bug in the first step"):
        fit(FailsFirstStep(), ThroughputMonitor())
    assert not _get_current_dispatch_mode_stack()


def test_counting_where_threads_compute_is_refused_in_one_line():
    """pipe runs on CPU; dp, the other strategy of threads, stops at start there (tests/test_dp.py)."""
    import engine.strategies  # noqa: F401  registers pipe

    with pytest.raises(UserError, match=r"^callbacks.throughput.count_flops: PipeStrategy computes in threads"):
        fit(KeepsItsNet(TutorialCNN()), ThroughputMonitor(), strategy="pipe", devices=1)
    module = KeepsItsNet(TutorialCNN())
    fit(module, ThroughputMonitor(count_flops=False), strategy="pipe", devices=1)  # the way out it names
    assert not hasattr(module, "flops_per_batch")


@pytest.mark.parametrize(("name", "row"), [("NVIDIA H200", "h200 sxm1"), ("NVIDIA H200 NVL", "h200 nvl1")])
def test_an_h200_by_the_name_cuda_gives_it_gets_the_peak_of_lightnings_table(monkeypatch, name, row):
    """What CUDA calls an H200 Lightning 2.6 does not find in its table (it looks for "sxm1" or "nvl1"); when a
    Lightning finds it, this lookup can go."""
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS, get_available_flops

    from engine.callbacks.throughput import _peak_lightning_misses

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert get_available_flops(cuda, torch.bfloat16) is None
    assert _peak_lightning_misses(cuda, torch.bfloat16) == _CUDA_FLOPS[row][torch.bfloat16]
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert _peak_lightning_misses(cuda, torch.float32) == _CUDA_FLOPS[row]["tfloat32"]
    assert _peak_lightning_misses(torch.device("cpu"), torch.float32) is None
    # the README: Lightning's Hopper peaks are the datasheets' with sparsity, twice the dense 989 TFLOP/s in bf16
    assert _CUDA_FLOPS["h200 sxm1"][torch.bfloat16] == pytest.approx(2 * 989e12, rel=0.02)


@pytest.mark.slow
def test_under_pipeline_counting_is_refused_and_the_rates_are_the_pipelines_not_the_stages(cli, tmp_path):
    """Two processes, one pipeline: every sample goes through both stages, so the run's rate is the device's
    (Lightning multiplied it by the two processes)."""
    from conftest import run_dirs, tensorboard_scalars

    base = ["trainer=pipeline", "trainer.accelerator=cpu", "callbacks=[default,throughput]", "test=false"]
    tiny = {"PROJECT_PROFILE": "tiny"}
    refused = cli("train.py", *base, env=tiny, check=False, cwd=tmp_path / "refused")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: callbacks.throughput.count_flops: PipelineStrategy computes each stage in a process of its own"
        )
    )
    cli("train.py", *base, "callbacks.throughput.count_flops=false", "callbacks.throughput.window_size=2",
        env=tiny, cwd=tmp_path / "run")  # fmt: skip
    (run,) = run_dirs(tmp_path / "run" / "logs")
    scalars = tensorboard_scalars(run)
    assert scalars["train/device/samples_per_sec"] and "train/samples_per_sec" not in scalars  # one data stream


@pytest.mark.slow
def test_under_ddp_mfu_divides_by_one_devices_peak_and_the_runs_by_all_of_theirs(cli, tmp_path):
    """Two processes: each device's MFU is its FLOP rate over one device's peak, and the run's FLOP rate is both
    devices'. (MFU was tested on one process only, where a peak multiplied by the world size is the same.)"""
    from conftest import run_dirs, tensorboard_scalars

    peak = 1e9
    cli("train.py", "trainer=ddp", "trainer.accelerator=cpu", "model=mlp", "callbacks=[default,throughput]",
        "callbacks.throughput.window_size=2", f"callbacks.throughput.peak_flops={peak}", "test=false",
        env={"PROJECT_PROFILE": "tiny"})  # fmt: skip
    (run,) = run_dirs(tmp_path / "logs")
    s = tensorboard_scalars(run)
    assert s["train/device/mfu"]
    for step, mfu in s["train/device/mfu"].items():
        assert mfu == pytest.approx(s["train/device/flops_per_sec"][step] / peak)
        assert s["train/flops_per_sec"][step] == pytest.approx(2 * s["train/device/flops_per_sec"][step])
