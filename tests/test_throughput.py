"""The FLOP count of `callbacks=[default,throughput]` (project.callbacks.throughput) on users' LightningModules, in
this process: a module's own `flops_per_batch` is kept, a failing first batch leaves no counter behind, and what
cannot be counted (dp, pipe: threads) is refused in one line. The count itself, in TensorBoard, is checked on a
user's CNN through the CLI in tests/test_averaging.py; on a GPU, with MFU, in tests/test_gpu.py."""

import lightning.pytorch as L
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from user_models import KeepsItsNet, LitAutoEncoder, TutorialCNN

from project.callbacks.throughput import ThroughputMonitor
from project.errors import UserError


class Digits(L.LightningDataModule):
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 1, 28, 28), torch.zeros(64, dtype=torch.long))
        return torch.utils.data.DataLoader(data, batch_size=16)


def tutorial_cnn_flops(batch: int) -> int:
    """One training batch of the user's CNN, counted apart from any run: Lightning's measure_flops over forward,
    loss and backward (the input needs no gradient, as in training)."""
    from lightning.fabric.utilities.throughput import measure_flops

    net, x, y = TutorialCNN(), torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return measure_flops(net, lambda: net(x), lambda logits: torch.nn.functional.cross_entropy(logits, y))


def fit(module: L.LightningModule, monitor: ThroughputMonitor, **trainer: object) -> None:
    options = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False)
    options.update(enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(callbacks=[monitor], **{**options, **trainer}).fit(module, datamodule=Digits())


def test_the_first_batch_is_counted_once_and_a_modules_own_count_is_kept():
    counted = LitAutoEncoder()
    fit(counted, ThroughputMonitor())
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

    peak = 1e9
    logger = CSVLogger(tmp_path, name="t")
    fit(LitAutoEncoder(), ThroughputMonitor(window_size=2, peak_flops=peak), logger=logger, log_every_n_steps=1)
    (path,) = tmp_path.glob("t/*/metrics.csv")
    rows = [row for row in csv.DictReader(path.open()) if row.get("train/device/mfu")]
    assert rows
    for row in rows:
        assert float(row["train/device/mfu"]) == pytest.approx(float(row["train/device/flops_per_sec"]) / peak)


@pytest.mark.parametrize("peak", [0, -1.0, "fast", True])
def test_a_peak_that_is_not_a_positive_number_is_refused(peak):
    with pytest.raises(UserError, match=r"^callbacks.throughput.peak_flops="):
        ThroughputMonitor(peak_flops=peak)


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
    import project.strategies  # noqa: F401  registers pipe

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

    from project.callbacks.throughput import _peak_lightning_misses

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert get_available_flops(cuda, torch.bfloat16) is None
    assert _peak_lightning_misses(cuda, torch.bfloat16) == _CUDA_FLOPS[row][torch.bfloat16]
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert _peak_lightning_misses(cuda, torch.float32) == _CUDA_FLOPS[row]["tfloat32"]
    assert _peak_lightning_misses(torch.device("cpu"), torch.float32) is None
