"""Weight averaging (`callbacks=[default,ema]`, `[default,swa]`) and throughput (`[default,throughput]`) through
Lightning's own callbacks, on a user's net and a user's LightningModule: the average is the EMA of the steps (as
computed here), what the checkpoints hold and what the test runs; a killed run resumes it bit for bit; SWA is
the mean of the epoch ends it names; TensorBoard gets samples per second; what cannot work is refused."""

import os
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from conftest import run_dirs, tensorboard_scalars
from test_fault_tolerance import assert_same_weights, train
from test_throughput import tutorial_cnn_flops

pytestmark = pytest.mark.slow

STEPS = 8 * 3  # 8 training batches per epoch, 3 epochs
DECAY = 0.9  # an average that moves enough in 24 steps to differ from the first weights
SIZES = ["data.batch_size=32", "trainer.max_epochs=3", "+trainer.limit_train_batches=8", "+trainer.limit_val_batches=2"]
RUN = [
    "seed=1",
    "trainer.deterministic=true",
    "~model.net",
    "+model.net._target_=user_models.TutorialCNN",  # a user's net (with BatchNorm): tests/user_models.py
    *SIZES,
    "callbacks.last_checkpoint.every_n_steps=3",
    "+callbacks.probe._target_=probes.KillAt",
]
EMA = [*RUN, "callbacks=[default,ema,throughput]", f"callbacks.ema.decay={DECAY}"]


class Record(L.Callback):
    """$RECORD_TO=<dir>: the raw weights after every optimizer step (steps.pt), and the weights the test of the
    best checkpoint runs with (tested.pt)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.steps, Path(os.environ["RECORD_TO"]) / "steps.pt")

    def on_test_start(self, trainer, pl_module) -> None:
        torch.save(pl_module.state_dict(), Path(os.environ["RECORD_TO"]) / "tested.pt")


def _saved(run: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)


def _floats(state: dict[str, torch.Tensor], prefix: str = "net.") -> dict[str, torch.Tensor]:
    """The net's parameters and float buffers (BatchNorm's running statistics): what is averaged. The classifier's
    metric states in its state_dict (val_acc_best) are neither, and num_batches_tracked is an integer."""
    return {k: v for k, v in state.items() if k.startswith(prefix) and v.is_floating_point()}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("unbroken")
    record = ["+callbacks.record._target_=test_averaging.Record", "+trainer.limit_test_batches=2"]
    train(work, *EMA, *record, env={"RECORD_TO": str(work)})
    (run,) = run_dirs(work / "logs")
    return run, work


def test_ema_is_the_average_of_the_steps_and_the_checkpoints_and_the_test_use_it(unbroken):
    run, work = unbroken
    steps = torch.load(work / "steps.pt", weights_only=True)
    assert len(steps) == STEPS
    ema = _floats(steps[0])  # the first update copies the weights, each later one moves the average
    for step in steps[1:]:
        ema = {k: DECAY * v + (1 - DECAY) * step[k] for k, v in ema.items()}
    last = _saved(run)
    assert int(last["averaging_state"]["n_averaged"]) == STEPS
    for name, value in _floats(last["state_dict"]).items():
        torch.testing.assert_close(value, ema[name], rtol=0, atol=1e-6)
    assert_same_weights(_floats(last["current_model_state"]), _floats(steps[-1]))  # the raw weights beside it

    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")  # what training tests (save_top_k=1)
    best_saved, tested = _saved(run, best.name), torch.load(work / "tested.pt", weights_only=True)
    assert_same_weights(_floats(tested), _floats(best_saved["state_dict"]))  # the average, not the raw weights:
    raw = _floats(best_saved["current_model_state"])  # Lightning 2.6 alone would test these
    assert max(float((raw[k] - tested[k]).abs().max()) for k in raw) > 1e-3


def test_a_killed_run_resumes_the_average_bit_for_bit_and_not_without_the_callback(tmp_path, unbroken):
    want = _saved(unbroken[0])
    killed = train(tmp_path / "killed", *EMA, "test=false", env={"KILL_AT_STEP": "5"}, check=False)
    assert killed.returncode == -9
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    assert int(_saved(run)["averaging_state"]["n_averaged"]) == 3  # saved at step 3, mid-epoch
    train(tmp_path / "resumed", *EMA, "test=false", f"ckpt_path={last}")
    (resumed,) = run_dirs(tmp_path / "resumed" / "logs")
    got = _saved(resumed)
    assert_same_weights(got["state_dict"], want["state_dict"])  # the average, continued
    assert_same_weights(got["current_model_state"], want["current_model_state"])  # and the weights it averages
    assert int(got["averaging_state"]["n_averaged"]) == STEPS

    # without the callback the run would go on from the average, not from the weights it stopped at
    refused = train(tmp_path / "plain", *RUN, "test=false", f"ckpt_path={last}", check=False)
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: ckpt_path={last}: saved with weight averaging (its weights are the average); resume it with"
        )
    )
    # under another averaging, SWA would go on from EMA's state
    swa = train(tmp_path / "swa", *RUN, "callbacks=[default,swa]", "test=false", f"ckpt_path={last}", check=False)
    assert swa.returncode == 2 and swa.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path={last}: saved with callbacks.ema's average, resumed with callbacks.swa, which would go on "
        "from ema's state; resume with 'callbacks=[default,ema]', or start a new run"
    )


def test_two_weight_averagings_at_once_are_refused_at_start(tmp_path):
    """callbacks=[default,ema,swa] trained to exit 0 with the raw weights corrupted: each swapped its average into
    the weights the other averaged."""
    proc = train(tmp_path, *RUN, "callbacks=[default,ema,swa]", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: callbacks.ema and callbacks.swa: two weight averagings of one model, each averaging the other's "
        "swapped-in weights; keep one"
    )
    assert not (tmp_path / "logs" / "train" / "runs").exists() or not run_dirs(tmp_path / "logs")


def test_throughput_and_the_counted_flops_are_in_tensorboard_and_no_mfu_on_cpu(unbroken):
    scalars = tensorboard_scalars(unbroken[0])
    samples = scalars["train/device/samples_per_sec"]
    assert samples and all(step >= 9 and v > 0 for step, v in samples.items())  # logging steps once 10 were timed
    assert {"train/device/batches_per_sec", "train/samples"} <= set(scalars)
    # the first batch's FLOPs, counted in the run (the module has no flops_per_batch), are one batch's of the net
    flops, batches = scalars["train/device/flops_per_sec"], scalars["train/device/batches_per_sec"]
    assert set(flops) == set(batches)
    per_batch = tutorial_cnn_flops(32)
    for step in flops:
        assert flops[step] == pytest.approx(per_batch * batches[step], rel=1e-5)
    log = (unbroken[0] / "train.log").read_text()
    assert f"Throughput: one training batch costs {per_batch:,} FLOPs" in log
    assert not [t for t in scalars if "mfu" in t]  # a CPU has no known peak


def test_swa_on_a_users_module_is_the_mean_of_the_epoch_ends_from_start_epoch_on(tmp_path):
    """model=autoencoder: a LightningModule of another task, written as users write theirs."""
    args = ["seed=1", "trainer.deterministic=true", "model=autoencoder", *SIZES, "test=false", "logger=none"]
    swa = ["callbacks=[default,swa]", "callbacks.model_checkpoint.save_top_k=-1"]
    record = "+callbacks.record._target_=test_averaging.Record"
    train(tmp_path / "swa", *args, *swa, record, env={"RECORD_TO": str(tmp_path)})
    (run,) = run_dirs(tmp_path / "swa" / "logs")
    steps = torch.load(tmp_path / "steps.pt", weights_only=True)
    ends = [_floats(steps[8 * epoch + 7], "") for epoch in range(3)]  # the weights at each epoch's end
    last = _saved(run)
    assert int(last["averaging_state"]["n_averaged"]) == 2  # start_epoch=1: the ends of epochs 1 and 2
    assert len(ends[0]) >= 4
    for name, value in _floats(last["state_dict"], "").items():
        torch.testing.assert_close(value, (ends[1][name] + ends[2][name]) / 2, rtol=0, atol=1e-7)
    # before the first update, the trained weights: Lightning alone validates and saves its copy of the initial ones
    first = _saved(run, "epoch_000.ckpt")
    assert "current_model_state" not in first
    assert_same_weights(_floats(first["state_dict"], ""), ends[0])

    late = train(tmp_path / "late", *args, *swa, "callbacks.swa.start_epoch=5")  # past the run's 3 epochs
    assert "callbacks.swa: training ended before the first update of the average" in late.stdout + late.stderr
    (run,) = run_dirs(tmp_path / "late" / "logs")
    assert "averaging_state" not in _saved(run)


def test_averaging_a_model_a_strategy_splits_is_refused_in_one_line(tmp_path):
    proc = train(tmp_path, *RUN, "trainer=pipe", "trainer.accelerator=cpu", "callbacks=[default,ema]", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: callbacks.ema: Lightning averages whole models, and PipeStrategy splits this one; use one device or "
        "ddp, or drop it from callbacks"
    )
