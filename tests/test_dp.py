"""strategy=dp: the scatter / per-replica step / reduce logic, on CPU through the simulated replica ops.

On CPU torch's DataParallel does not replicate at all, so these tests drive the same strategy code
with `simulated_ops()`: real shallow replicas (as torch's replicate makes them) run one after another.
"""

from functools import partial

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from probes import StepLosses
from torchmetrics import Metric

from engine.strategies.dp import DataParallelStrategy, _split, simulated_ops
from engine.strategies.pieces import combine
from project.data.digits import DigitsDataModule
from project.models.classifier import ImageClassifier
from project.models.mlp import MLP


class LabelSum(Metric):
    """A custom metric left at torchmetrics' default full_state_update (None)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, labels: torch.Tensor) -> None:
        self.total += labels.float().sum()

    def compute(self) -> torch.Tensor:
        return self.total


class LogsEverything(ImageClassifier):
    """Logs what replicas must combine: sums, maxima, a custom metric, one metric under two names."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.label_sum = LabelSum()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        _, labels = batch
        self.log("seen", float(len(labels)), reduce_fx="sum", on_step=True, on_epoch=False)
        self.log("max_label", labels.max().float(), reduce_fx="max", on_step=True, on_epoch=False)
        self.label_sum(labels)
        self.log("label_sum", self.label_sum, on_step=False, on_epoch=True)
        self.log("train/acc_again", self.train_acc, on_step=False, on_epoch=True)
        return loss


class LogsPerChunk(ImageClassifier):
    def training_step(self, batch, batch_idx):
        self.log(f"chunk_of_{len(batch[1])}", 1.0)
        return super().training_step(batch, batch_idx)


def fit(strategy, devices: int, module: type = ImageClassifier, accelerator: str = "cpu"):
    L.seed_everything(0)
    model = module(net=MLP(dropout=0.0), optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    losses = StepLosses()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_epochs=2,
        limit_train_batches=8,
        limit_val_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(model, DigitsDataModule(batch_size=50))
    return losses.losses, model.net.state_dict(), {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_dp_on_a_cpu_accelerator_is_refused_naming_ddp():
    import engine.strategies  # noqa: F401

    with pytest.raises(MisconfigurationException, match="trainer.strategy=ddp trainer.accelerator=cpu"):
        L.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)


def test_split_chunks_tensors_and_copies_the_rest():
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    parts = _split(((x, y), 7), 2)
    assert [p[0][0].shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p[0][1] for p in parts]), y)
    assert [p[1] for p in parts] == [7, 7]
    assert len(_split((torch.ones(1, 3), 0), 2)) == 1  # a batch smaller than the device count uses fewer


def test_combine_weights_scalars_by_chunk_size_and_concatenates_batches():
    root = torch.device("cpu")
    losses = [torch.tensor(1.0), torch.tensor(4.0)]
    assert combine(losses, [3, 1], root).item() == pytest.approx(1.75)
    out = combine(
        [{"loss": torch.tensor(2.0), "preds": torch.zeros(3)}, {"loss": torch.tensor(2.0), "preds": torch.ones(1)}],
        [3, 1],
        root,
    )
    assert out["loss"].item() == 2.0 and out["preds"].tolist() == [0, 0, 0, 1]


def test_dp_with_two_replicas_trains_exactly_like_one_device():
    single_losses, single_weights, single_metrics = fit("auto", 1)
    dp_losses, dp_weights, dp_metrics = fit(DataParallelStrategy(ops=simulated_ops()), 2)
    assert len(dp_losses) == len(single_losses) == 16
    torch.testing.assert_close(torch.tensor(dp_losses), torch.tensor(single_losses), atol=1e-5, rtol=0)
    for name, weight in single_weights.items():
        torch.testing.assert_close(dp_weights[name], weight, atol=1e-5, rtol=0)
    # metrics logged inside the replicas (torchmetrics objects) come out as on one device
    for key in ("train/acc", "train/loss_epoch", "val/acc", "val/loss", "val/acc_best"):
        assert dp_metrics[key] == pytest.approx(single_metrics[key], abs=1e-5), key


def test_uneven_chunks_still_give_the_full_batch_loss():
    # 50 samples per batch over 3 replicas: chunks of 17, 17, 16
    single_losses, _, _ = fit("auto", 1)
    dp_losses, _, _ = fit(DataParallelStrategy(ops=simulated_ops(), parallel_devices=[torch.device("cpu")] * 3), 3)
    torch.testing.assert_close(torch.tensor(dp_losses), torch.tensor(single_losses), atol=1e-5, rtol=0)


def test_values_metrics_and_custom_metrics_logged_in_replicas_combine_exactly():
    _, _, single = fit("auto", 1, LogsEverything)
    _, _, dp = fit(
        DataParallelStrategy(ops=simulated_ops(), parallel_devices=[torch.device("cpu")] * 3), 3, LogsEverything
    )
    assert dp["seen"] == single["seen"] == 50  # summed over the replicas' chunks, not averaged
    for key in ("max_label", "label_sum", "train/acc_again", "train/acc"):
        assert dp[key] == pytest.approx(single[key], abs=1e-5), key


def test_replicas_that_log_different_keys_are_an_error_not_a_silent_mix():
    with pytest.raises(MisconfigurationException, match="pieces of one batch logged different keys"):
        fit(DataParallelStrategy(ops=simulated_ops(), parallel_devices=[torch.device("cpu")] * 3), 3, LogsPerChunk)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_dp_on_two_gpus_trains_like_one():
    # the same module and data on 2 real GPUs, through torch's replicate/parallel_apply
    single_losses, _, single_metrics = fit("auto", 1, accelerator="gpu")
    dp_losses, _, dp_metrics = fit("dp", 2, LogsEverything, accelerator="gpu")
    torch.testing.assert_close(torch.tensor(dp_losses), torch.tensor(single_losses), atol=1e-4, rtol=0)
    assert dp_metrics["val/acc"] == pytest.approx(single_metrics["val/acc"], abs=1e-3)
    assert dp_metrics["seen"] == 50


def test_simulated_replicas_keep_batchnorm_statistics_like_torch_does():
    """torch's replicate hands replica 0 the root's buffers and the others copies: after a dp step the root's
    running statistics are those of replica 0's chunk only."""
    from engine.strategies.dp import _replicate_sharing_parameters
    from project.models.lenet import LeNet

    torch.manual_seed(0)
    net = LeNet().train()
    reference = LeNet().train()
    reference.load_state_dict(net.state_dict())
    chunks = torch.randn(2, 4, 1, 28, 28).unbind(0)
    for replica, chunk in zip(_replicate_sharing_parameters(net, 2), chunks):
        replica(chunk)
    reference(chunks[0])
    bn, expected = net.features[1], reference.features[1]
    assert int(bn.num_batches_tracked) == 1  # one update, not one per replica
    torch.testing.assert_close(bn.running_mean, expected.running_mean)
    torch.testing.assert_close(bn.running_var, expected.running_var)
