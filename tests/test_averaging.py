"""Weight averaging (`callbacks=[default,ema]`, `[default,swa]`) and throughput (`[default,throughput]`) through
Lightning's own callbacks, on a user's net: the checkpoints hold the average, a killed run resumes it bit for
bit, SWA is the mean of the epoch ends it names, and TensorBoard gets samples per second."""

import glob
from pathlib import Path

import pytest
import torch
from conftest import run_dirs
from test_fault_tolerance import assert_same_weights, train

pytestmark = pytest.mark.slow

STEPS = 8 * 3  # 8 training batches per epoch, 3 epochs
RUN = [
    "seed=1",
    "trainer.deterministic=true",
    "~model.net",
    "+model.net._target_=user_models.TutorialCNN",  # a user's net: tests/user_models.py
    "data.batch_size=32",
    "trainer.max_epochs=3",
    "+trainer.limit_train_batches=8",
    "+trainer.limit_val_batches=2",
    "test=false",
    "callbacks.last_checkpoint.every_n_steps=3",
    "+callbacks.probe._target_=probes.KillAt",
]
EMA = [*RUN, "callbacks=[default,ema,throughput]"]


def _saved(run: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("unbroken")
    train(work, *EMA)
    (run,) = run_dirs(work / "logs")
    return run


def test_ema_is_what_the_checkpoint_holds_and_a_killed_run_resumes_it_bit_for_bit(tmp_path, unbroken):
    want = _saved(unbroken)
    assert int(want["averaging_state"]["n_averaged"]) == STEPS  # one update per optimizer step
    raw, average = want["current_model_state"], want["state_dict"]
    assert raw.keys() == average.keys() and any(not torch.equal(raw[k], average[k]) for k in raw)

    killed = train(tmp_path / "killed", *EMA, env={"KILL_AT_STEP": "5"}, check=False)
    assert killed.returncode == -9
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    train(tmp_path / "resumed", *EMA, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    (resumed,) = run_dirs(tmp_path / "resumed" / "logs")
    got = _saved(resumed)
    assert_same_weights(got["state_dict"], average)  # the average, continued
    assert_same_weights(got["current_model_state"], raw)  # and the weights it averages
    assert int(got["averaging_state"]["n_averaged"]) == STEPS


def test_throughput_is_in_tensorboard(unbroken):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for path in glob.glob(str(unbroken / "tensorboard" / "**" / "events.*"), recursive=True):
        events = EventAccumulator(path)
        events.Reload()
        if "train/device/samples_per_sec" in events.Tags()["scalars"]:
            values += [(e.step, e.value) for e in events.Scalars("train/device/samples_per_sec")]
    assert values and all(step >= 9 and v > 0 for step, v in values)  # logging steps (0-based) once 10 were timed


def test_swa_is_the_mean_of_the_epoch_ends_from_start_epoch_on(tmp_path):
    train(tmp_path, *RUN, "logger=none", "callbacks=[default,swa]", "callbacks.model_checkpoint.save_top_k=-1")
    (run,) = run_dirs(tmp_path / "logs")
    ends = [_saved(run, f"epoch_00{e}.ckpt")["current_model_state"] for e in (1, 2)]  # start_epoch=1: epochs 1, 2
    last = _saved(run)
    assert int(last["averaging_state"]["n_averaged"]) == 2
    # the net's weights; metric states in the state_dict (val_acc_best) are not parameters or buffers: not averaged
    floats = {k: v for k, v in last["state_dict"].items() if k.startswith("net.") and v.is_floating_point()}
    assert floats
    for name, value in floats.items():
        torch.testing.assert_close(value, (ends[0][name] + ends[1][name]) / 2, rtol=0, atol=1e-7)
