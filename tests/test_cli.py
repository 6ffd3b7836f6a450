"""The real entry points in subprocesses: train, evaluate, resume, DDP, help, errors, devices."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_dirs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow


def test_help_lists_groups_without_importing_torch():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "== Configuration groups ==" in proc.stdout and "trainer: " in proc.stdout
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "hydra" in imported
    assert not imported & {"torch", "lightning", "torchvision", "torchmetrics"}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.max_epoch=3", "trainer.max_epoch: no such key; did you mean trainer.max_epochs?"),
        ("model=lenett", "Could not find 'model/lenett'"),
        (
            "+trainer.max_epoch=3",
            "trainer.max_epoch: lightning.pytorch.Trainer has no option 'max_epoch'; did you mean 'max_epochs'?",
        ),
        ("ckpt_path=/no/such.ckpt", "ckpt_path=/no/such.ckpt: no such file"),
        pytest.param(
            "trainer=dp",
            "On CPU use trainer.strategy=ddp trainer.accelerator=cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="dp runs where CUDA is"),
        ),
    ],
)
def test_bad_input_is_one_error_line_and_no_output(cli, tmp_path, override, expected):
    proc = cli("train.py", override, check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert run_dirs(tmp_path / "logs") == []


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default run exactly as a user starts it, plus the CSV logger for the resume check."""
    tmp = tmp_path_factory.mktemp("trained")
    cmd = [sys.executable, "train.py", f"paths.log_dir={tmp / 'logs'}", "logger=[tensorboard,csv]"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = run_dirs(tmp / "logs")
    return run


def test_default_run_reaches_95_percent_on_real_digits(trained):
    test = json.loads((trained / "test_metrics.json").read_text())
    assert test["test/acc"] >= 0.95
    fit = json.loads((trained / "fit_metrics.json").read_text())
    assert fit["val/acc_best"] >= 0.95


def test_run_dir_holds_config_checkpoints_and_tensorboard_events(trained):
    assert (trained / ".hydra" / "config.yaml").is_file()
    ckpts = {p.name for p in (trained / "checkpoints").iterdir()}
    assert "last.ckpt" in ckpts and any(n.startswith("epoch_") for n in ckpts)
    scalars, hparams_tags = set(), set()
    for events in (trained / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events)).Reload()
        scalars |= set(acc.Tags()["scalars"])
        hparams_tags |= set(acc.PluginTagToContent("hparams"))  # what TensorBoard's HParams tab reads
    assert {
        "train/loss_step",
        "train/loss_epoch",
        "train/acc",
        "val/loss",
        "val/acc",
        "val/acc_best",
        "test/acc",
        "test/loss",
    } <= scalars
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= hparams_tags


def test_checkpoints_hold_only_plain_data(trained):
    for path in (trained / "checkpoints").glob("*.ckpt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        config = ckpt["hyper_parameters"]
        assert config["model"]["net"]["_target_"] == "project.models.lenet.LeNet"
        assert config["seed"] == 12345


def test_eval_of_best_checkpoint_gives_the_training_runs_test_accuracy(cli, tmp_path, trained):
    (best,) = (trained / "checkpoints").glob("epoch_*.ckpt")
    cli("eval.py", f"ckpt_path={best}")
    (run,) = run_dirs(tmp_path / "logs", task="eval")
    evaluated = json.loads((run / "test_metrics.json").read_text())
    tested = json.loads((trained / "test_metrics.json").read_text())
    assert evaluated["test/acc"] == tested["test/acc"]
    assert evaluated["test/loss"] == pytest.approx(tested["test/loss"], rel=1e-6)


def test_resume_continues_at_the_next_epoch(cli, tmp_path, trained):
    last = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    done_epochs, steps = last["epoch"] + 1, last["global_step"]
    cli(
        "train.py",
        f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}",
        f"trainer.max_epochs={done_epochs + 2}",
        "logger=csv",
        "~callbacks.early_stopping",
    )
    (run,) = run_dirs(tmp_path / "logs")
    resumed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == done_epochs + 1
    assert resumed["global_step"] == steps + 2 * (steps // done_epochs)
    with open(run / "csv" / "metrics.csv") as f:
        epochs = {int(row["epoch"]) for row in csv.DictReader(f) if row["val/acc"]}
    assert epochs == {done_epochs, done_epochs + 1}
    # the best validation accuracy so far is part of the checkpoint: it does not restart at the resume
    before = json.loads((trained / "fit_metrics.json").read_text())["val/acc_best"]
    assert json.loads((run / "fit_metrics.json").read_text())["val/acc_best"] >= before


def test_resuming_with_another_network_is_refused_by_name(cli, tmp_path, trained):
    proc = cli("train.py", f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}", "model=mlp", check=False)
    assert proc.returncode == 2
    assert "was trained with model.net=" in proc.stderr and "resume with the checkpoint's model config" in proc.stderr


def test_a_failed_start_leaves_a_dir_the_user_named_alone(cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.log").write_text("keep me")
    proc = cli("train.py", f"hydra.run.dir={mine}", "+foo=1", check=False)
    assert proc.returncode == 2 and (mine / "notes.log").read_text() == "keep me"


def test_ddp_two_cpu_processes_share_one_run_dir_and_split_the_data(cli, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    cli(
        "train.py",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "model=mlp",
        "data._target_=probes.CountingDigits",
        "+callbacks.probe._target_=probes.ShardProbe",
        "~callbacks.early_stopping",
        env={"PROBE_DIR": str(probe)},
    )
    (run,) = run_dirs(tmp_path / "logs")
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "test_metrics.json").is_file()
    # Only rank 0 prepares, once per Trainer entry point (fit, then test); rank 1 never does.
    assert (probe / "prepare_data.calls").read_text().split() == ["0", "0"]

    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in ("0", "1"):
        shard0, shard1 = (set(r["seen"][epoch]) for r in ranks)
        assert len(shard0) == len(shard1) == 1750  # 3500 training digits, half each
        assert not shard0 & shard1
    assert ranks[0]["seen"]["0"] != ranks[0]["seen"]["1"]  # reshuffled between epochs
    for key in ("val/acc", "val/loss", "train/acc"):
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key]


def test_devices_command_reports_the_machine(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "project.launch.devices"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CUDA_VISIBLE_DEVICES: \n" in out or "CUDA_VISIBLE_DEVICES: " in out
    assert "CUDA: none available" in out  # hidden by CUDA_VISIBLE_DEVICES=""
    assert "CPU: " in out and "cores" in out
    assert "Default trainer (accelerator=auto, devices=1) picks: CPUAccelerator on cpu" in out
