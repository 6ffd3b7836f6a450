"""The real entry points in subprocesses: train, evaluate, resume, DDP, help, devices (refusals: test_cli_errors.py)."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow


def test_help_lists_the_groups_a_user_picks_without_importing_torch():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    options = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert ["model", "autoencoder"] == options[[o[0] for o in options].index("model")][:2]
    assert any(o[0] == "lenet*" for o in options) and any(o[0] == "hydra/launcher" for o in options)
    assert "_tiny" not in proc.stdout and "profile/" not in proc.stdout  # the test suite's sizes
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "hydra" in imported
    assert not imported & {"torch", "lightning", "torchvision", "torchmetrics"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default run exactly as a user starts it, plus the CSV logger for the resume check."""
    tmp = tmp_path_factory.mktemp("trained")
    cmd = [sys.executable, str(REPO / "train.py"), "logger=[tensorboard,csv]"]
    proc = run_python(cmd, tmp, cli_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = run_dirs(tmp / "logs")
    return run


def test_default_run_reaches_95_percent_on_real_digits(trained):
    test = json.loads((trained / "test_metrics.json").read_text())
    assert test["test/acc"] >= 0.965  # README: "about 97% test accuracy"
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
        try:  # what TensorBoard's HParams tab reads; written to the first events file only
            hparams_tags |= set(acc.PluginTagToContent("hparams"))
        except KeyError:
            pass
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
    # the run's session only: TensorBoard builds the HParams table from every run's session and its own scalars
    # (an experiment summary written by one run would fix the columns for all of them)
    assert hparams_tags == {"_hparams_/session_start_info"}


def test_the_run_log_holds_no_tips_for_lightnings_cloud_services(trained):
    """Lightning 2.6 logs two in every run (litlogger, litmodels), on the console and into the run's log."""
    log = (trained / "train.log").read_text()
    assert "Tested " in log and "`Trainer.fit` stopped" in log  # the log holds our lines, and Lightning's
    assert "💡" not in log and "litlogger" not in log and "litmodels" not in log


def test_checkpoints_hold_only_plain_data(trained):
    for path in (trained / "checkpoints").glob("*.ckpt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        config = ckpt["run_config"]
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


def test_resume_continues_at_the_next_epoch_with_the_best_so_far(cli, tmp_path, trained):
    last = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    done_epochs, steps = last["epoch"] + 1, last["global_step"]
    # A best-so-far that no epoch can reach (500 validation digits: accuracies are multiples of 0.002). Unless
    # the resumed run restores it, its val/acc_best is the best of its own epochs.
    last["state_dict"]["val_acc_best.max_value"] = torch.tensor(0.9999)
    planted = tmp_path / "planted.ckpt"
    torch.save(last, planted)
    cli(
        "train.py",
        f"ckpt_path={planted}",
        f"trainer.max_epochs={done_epochs + 2}",
        "stretch_schedule=true",
        "logger=csv",
        "~callbacks.early_stopping",
    )
    (run,) = run_dirs(tmp_path / "logs")
    resumed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == done_epochs + 1
    assert resumed["global_step"] == steps + 2 * (steps // done_epochs)
    with open(run / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["val/acc"]]
    assert {int(row["epoch"]) for row in rows} == {done_epochs, done_epochs + 1}
    assert all(float(row["val/acc"]) < 0.9999 for row in rows)
    assert json.loads((run / "fit_metrics.json").read_text())["val/acc_best"] == pytest.approx(0.9999)


def test_an_epoch_resumed_at_its_end_logs_no_empty_train_metrics(cli, tmp_path):
    """With validation every 2nd epoch, last.ckpt is saved at validation end, before the epoch's end hooks. A run
    resumed from it ends that epoch again without a training step: it must not log train/acc 0 and a NaN loss."""
    args = ["model=mlp", "logger=csv", "trainer.check_val_every_n_epoch=2", "test=false"]
    cli("train.py", *args, env={"PROJECT_PROFILE": "tiny"})  # 2 epochs
    (first,) = run_dirs(tmp_path / "logs")
    resume = [f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=4", "stretch_schedule=true"]
    proc = cli("train.py", *args, *resume, env={"PROJECT_PROFILE": "tiny"})
    (resumed,) = [run for run in run_dirs(tmp_path / "logs") if run != first]
    with open(resumed / "csv" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row["train/acc"]]
    assert {int(row["epoch"]) for row in logged} == {2, 3}
    assert all(0 < float(row["train/loss_epoch"]) < 10 for row in logged)
    assert "was called before the ``update`` method" not in proc.stderr


def test_resuming_with_another_network_is_refused_by_name(cli, tmp_path, trained):
    proc = cli("train.py", f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}", "model=mlp", check=False)
    assert proc.returncode == 2
    assert "was trained with model.net=" in proc.stderr and "resume with the checkpoint's model config" in proc.stderr


def test_ddp_two_cpu_processes_share_one_run_dir_and_split_the_data(cli, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = cli(
        "train.py",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "model=mlp",
        "data._target_=probes.CountingDigits",
        "+callbacks.probe._target_=probes.ShardProbe",
        "~callbacks.early_stopping",
        "+callbacks.listen._target_=probes.ListenProbe",
        env={"PROBE_DIR": str(probe)},
    )
    (run,) = run_dirs(tmp_path / "logs")
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "test_metrics.json").is_file()
    # rank 0 alone on the console, as under ddp_spawn; rank 1 in its own log (it showed its set-up lines, repeated)
    assert "GLOBAL_RANK: 0" in proc.stdout and "GLOBAL_RANK: 1" not in proc.stdout + proc.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1" in (run / "train_ddp_process_1.log").read_text()
    # one machine: the rendezvous store listens on MASTER_ADDR (127.0.0.1) only, not on every interface
    assert json.loads((probe / "listen.json").read_text()) == ["127.0.0.1"]
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


def test_devices_command_reports_what_torch_sees_under_cuda_visible_devices():
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "3,5"}
    proc = run_python([sys.executable, "-m", "engine.launch.devices"], REPO, env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "CUDA_VISIBLE_DEVICES: 3,5"
    count = torch.cuda.device_count()  # this machine's count of visible GPUs (0 here)
    assert (f"CUDA: {count} device(s)" in proc.stdout) == (count > 0) and ("CUDA: none available" in proc.stdout) == (
        count == 0
    )
    expected = "CUDAAccelerator on cuda:0" if count else "CPUAccelerator on cpu"
    assert lines[-1] == f"Default trainer (accelerator=auto, devices=1) picks: {expected}"
    assert "srun" not in proc.stderr  # a login node with SLURM: no warning that this was not started by srun


def test_devices_lists_every_visible_gpu(monkeypatch):
    """The listing itself, with two GPUs faked at the torch API (CI has none)."""
    from types import SimpleNamespace

    from engine.launch import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(devices, "default_choice", lambda: "CUDAAccelerator on cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    props = SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    lines = devices.describe()
    assert lines[0] == "CUDA_VISIBLE_DEVICES: (empty: no GPU is visible)"
    assert [line.split()[0] for line in lines if line.startswith("  cuda:")] == ["cuda:0", "cuda:1"]
    assert "  cuda:1  Fake GPU  80.0 GiB  compute capability 9.0" in lines


@pytest.mark.parametrize("trainer", ["trainer=ddp", "trainer=pipe"])
def test_debug_fdr_keeps_the_devices_and_strategy_it_is_given(cli, tmp_path, trainer):
    """One batch of each stage under the strategy asked for, on every rank (it forced one device before)."""
    proc = cli("train.py", "debug=fdr", trainer, "trainer.accelerator=cpu", "print_config=false")
    (run,) = run_dirs(tmp_path / "logs")
    if trainer == "trainer=ddp":
        assert "MEMBER: 1/2" in proc.stdout + proc.stderr and (run / "train_ddp_process_1.log").is_file()
    else:
        assert "strategy=pipe: LeNet cut into" in proc.stdout + proc.stderr


def test_a_run_says_its_directory_at_start_and_end_and_shows_its_config(cli, tmp_path):
    proc = cli("train.py", "model=mlp", "trainer.max_epochs=1", env={"PROJECT_PROFILE": "tiny"})
    (run,) = run_dirs(tmp_path / "logs")
    said = proc.stdout + proc.stderr
    assert said.count(f"Run directory: {run}") == 2 and said.rstrip().endswith(f"Run directory: {run}")
    assert "├── model" in proc.stdout and "_target_: project.models.mlp.MLP" in proc.stdout
    quiet = cli("train.py", "model=mlp", "trainer.max_epochs=1", "print_config=false", env={"PROJECT_PROFILE": "tiny"})
    assert "├── model" not in quiet.stdout and "Run directory: " in quiet.stdout + quiet.stderr
