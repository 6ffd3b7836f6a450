"""Killed and diverging runs: a kill -9 at any step resumes bit for bit, a non-finite loss stops at once with a
clean checkpoint, a dead rank is named, a kill during a save leaves the previous checkpoint whole. Signals:
tests/test_signals.py."""

import json
import math
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, run_dirs, run_python

pytestmark = pytest.mark.slow

# 8 training batches per epoch, 3 epochs; dropout on (random state matters), shuffling on (order matters)
RUN = [
    "seed=1",
    "trainer.deterministic=true",
    "model=mlp",
    "data.batch_size=32",
    "trainer.max_epochs=3",
    "+trainer.limit_train_batches=8",
    "+trainer.limit_val_batches=2",
    "test=false",
    "logger=none",
    "callbacks.last_checkpoint.every_n_steps=3",
    "+callbacks.probe._target_=probes.KillAt",
]


def train(cwd: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = run_python([sys.executable, str(REPO / "train.py"), *args], cwd, cli_env(**(env or {})))
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# A user's table regression whose ReduceLROnPlateau halves the learning rate at every epoch's end; 11 batches an epoch
PLATEAU = [
    *[arg for arg in RUN if not arg.startswith(("model=", "data.", "+trainer.limit_train"))],
    "~model",
    "+model._target_=user_tables.PlateauRegressor",
    "~data",
    "+data._target_=user_tables.DiabetesData",
    "monitor.metric=val/mse",
    "monitor.mode=min",
]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    worst = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    assert worst == 0.0, f"largest weight difference after resume: {worst}"
    return worst


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("unbroken")
    train(work, *RUN)
    (run,) = run_dirs(work / "logs")
    return weights(run)


@pytest.mark.parametrize(
    ("kill_at", "wait"), [(5, True), (13, False)], ids=["mid-epoch-0", "mid-epoch-1-after-an-epoch-end-mid-write"]
)
def test_a_run_killed_at_any_step_resumes_bit_for_bit(tmp_path, unbroken, kill_at, wait):
    """`wait`: the kill comes once the saves before it are on disk; else at once, maybe while the writer thread is
    still writing the newest (engine.runs.atomic_io): the one before it is then the newest whole one."""
    env = {"KILL_AT_STEP": str(kill_at), **({} if wait else {"KILL_WITHOUT_WAITING": "1"})}
    killed = train(tmp_path / "killed", *RUN, env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    saved_at = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    saves = [s for s in (3, 6, 8, 9, 12) if s <= kill_at]  # step saves, and the epoch-end one
    assert saved_at == saves[-1] if wait else saved_at in saves[-2:]
    train(tmp_path / "resumed", *RUN, f"ckpt_path={last}")
    (resumed,) = run_dirs(tmp_path / "resumed" / "logs")
    assert_same_weights(weights(resumed), unbroken)


def test_a_run_resumed_twice_within_one_epoch_resumes_bit_for_bit(tmp_path, unbroken):
    """The loader's position survives two resumes in one epoch (a position count restarted at 0 replays data)."""
    train(tmp_path / "first", *RUN, env={"KILL_AT_STEP": "5"}, check=False)
    (first,) = run_dirs(tmp_path / "first" / "logs")
    second = train(
        tmp_path / "second",
        *RUN,
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        env={"KILL_AT_STEP": "7"},
        check=False,
    )
    assert second.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "second" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 6  # epoch 0 of 8 steps
    train(tmp_path / "third", *RUN, f"ckpt_path={last}")
    (third,) = run_dirs(tmp_path / "third" / "logs")
    assert_same_weights(weights(third), unbroken)


def test_ddp_killed_mid_epoch_resumes_bit_for_bit(tmp_path):
    """Each rank draws its own random stream (dropout) from the seed, over one shared data order; resume
    restores each rank's own state (restoring rank 0's on both would change rank 1's masks, and the weights)."""
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    probe = tmp_path / "probe"
    probe.mkdir()
    train(tmp_path / "unbroken", *ddp, env={"PROBE_DIR": str(probe)})
    (whole,) = run_dirs(tmp_path / "unbroken" / "logs")
    (state_0, *labels_0), (state_1, *labels_1) = [(probe / f"rng_{r}").read_text().split(" ", 1) for r in (0, 1)]
    assert state_0 != state_1  # different dropout masks
    assert labels_0 != labels_1  # different shards of the one order
    killed = train(tmp_path / "killed", *ddp, env={"KILL_AT_STEP": "5"}, check=False)
    assert killed.returncode != 0
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    train(tmp_path / "resumed", *ddp, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    (resumed,) = run_dirs(tmp_path / "resumed" / "logs")
    assert_same_weights(weights(resumed), weights(whole))


def test_a_dead_rank_is_named_in_one_line_within_seconds(tmp_path):
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    started = time.time()
    proc = train(tmp_path, *ddp, env={"KILL_AT_STEP": "4", "KILL_RANK": "1"}, check=False)
    assert proc.returncode == 1 and time.time() - started < 90
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    (run,) = run_dirs(tmp_path / "logs")
    assert len(lines) == 1 and "rank 1 (pid " in lines[0] and "killed by SIGKILL" in lines[0], proc.stderr[-2000:]
    assert lines[0].endswith(f"its log: {run}/train_ddp_process_1.log") and "Traceback" not in proc.stderr
    assert f"[ERROR] - {lines[0]}" in (run / "train.log").read_text()


# ddp with rank 0's mistake: test_hostile.py's data missing offline; ddp_spawn: test_trainer_options.py (a lost rank 1
# ends quietly, a worker's UserError comes back as itself) and the divergence below
@pytest.mark.parametrize(("strategy", "rank"), [("ddp", 1)])
def test_a_mistake_one_rank_alone_finds_is_said_once_in_its_words(tmp_path, strategy, rank):
    """Rank 0 says how the run ended. Rank 1's line showed beside it (its own error, or "lost the connection" when
    rank 0 had ended), and when rank 1 alone found it, rank 0 said only "rank 1 died (exit code 2)". Under
    ddp_spawn, rank 1's lost connection could be the error torch sent back first, and ended the run in its place."""
    ddp = [*RUN[:-1], f"trainer={strategy}", "trainer.accelerator=cpu", "data.batch_size=16"]
    env = {"MISTAKE_AT_STEP": "2", "MISTAKE_RANK": str(rank)}
    proc = train(tmp_path, *ddp, "+callbacks.probe._target_=probes.MistakeAt", env=env, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    mistake = f"rank {rank} alone found a mistake at step 2"
    if rank == 0 or strategy == "ddp_spawn":  # the main process says a spawned worker's error
        assert proc.returncode == 2 and errors == [f"error: {mistake}"], proc.stderr[-3000:]
    else:
        (run,) = run_dirs(tmp_path / "logs")
        log = run / "train_ddp_process_1.log"
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
        assert re.fullmatch(rf"error: rank 1 \(pid \d+\) died \(exit code 2: {mistake}\); its log: {log}", errors[0])
    assert "Traceback" not in proc.stderr


def test_a_diverging_run_stops_at_once_with_a_clean_checkpoint_and_valid_json(tmp_path):
    proc = train(tmp_path, *RUN, "model.optimizer.lr=1e12", "callbacks.last_checkpoint.every_n_steps=1", check=False)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: diverged in epoch 0, between steps ") and "trainer.gradient_clip_val" in line
    assert "lower the learning rate (model.optimizer.lr)" in line
    (run,) = run_dirs(tmp_path / "logs")
    assert (run / "train.log").read_text().splitlines()[-1].endswith(f"[ERROR] - {line}")  # how the run ended
    fit = json.loads((run / "fit_metrics.json").read_text())  # strict JSON: no NaN literal
    assert fit["status"] == "diverged"
    for path in (run / "checkpoints").glob("*.ckpt"):
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        assert all(bool(torch.isfinite(t).all()) for k, t in state.items() if k.startswith("net."))


def test_a_diverging_module_of_ones_own_is_told_its_own_learning_rate_key(tmp_path):
    """The line named the template's model.optimizer.lr, a key a user's module does not have."""
    proc = train(tmp_path, *PLATEAU, "+model.lr=1e12", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: diverged in epoch 0") and "lower the learning rate (model.lr)" in line, line


def test_a_nan_gradient_with_a_finite_loss_stops_before_any_checkpoint_holds_it(tmp_path):
    args = [*RUN[:-1], "+callbacks.probe._target_=probes.NanGradientAt", "callbacks.last_checkpoint.every_n_steps=1"]
    proc = train(tmp_path, *args, env={"NAN_GRAD_AT_STEP": "4"}, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: diverged in epoch 0, between steps 4 and 5: the weights stopped being finite")
    (run,) = run_dirs(tmp_path / "logs")
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 4
    assert all(bool(torch.isfinite(t).all()) for k, t in last["state_dict"].items() if k.startswith("net."))


def test_a_divergence_names_the_last_good_checkpoint_where_the_callbacks_write(tmp_path):
    """Checkpoints written outside the run dir (`dirpath`) are the ones the message names; it said "no checkpoint was
    saved yet" with two in that folder."""
    elsewhere = tmp_path / "elsewhere"
    args = [
        *RUN[:-2],
        "+callbacks.probe._target_=probes.NanGradientAt",
        "callbacks.run_checks.every_n_steps=1000",
        f"callbacks.model_checkpoint.dirpath={elsewhere}",
        f"callbacks.last_checkpoint.dirpath={elsewhere}",
    ]
    proc = train(tmp_path / "work", *args, env={"NAN_GRAD_AT_STEP": "12"}, check=False)  # epoch 1 (8 steps each)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: diverged in epoch 1, between steps 8 and 16: the "), line
    named = Path(line.split("the last good checkpoint is ")[1])
    assert named.parent == elsewhere and named.is_file(), line
    assert torch.load(named, map_location="cpu", weights_only=True)["global_step"] == 8


def test_a_diverging_sweep_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    proc = train(tmp_path, "-m", *RUN, "model.optimizer.lr=1e12,0.002", check=False)
    assert proc.returncode == 2
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert (sweep / "0" / "error.txt").read_text().startswith("diverged in epoch 0")
    assert "[ERROR] - error: sweep job 0 (" in (sweep / "0" / "train.log").read_text()  # the job's own log says it
    assert json.loads((sweep / "1" / "fit_metrics.json").read_text())["status"] == "ok"


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_run_diverging_in_two_processes_says_so_once(tmp_path, strategy):
    """Every rank finds the divergence at the same agreement. Under ddp each rank printed the line (and a rank's exit 2
    could reach rank 0's watcher first: "rank 1 died"); under ddp_spawn the main process printed a 60-line traceback,
    exited 1 and wrote no fit_metrics.json; the workers repeated warnings the main process leaves out."""
    args = [
        *RUN[:-1],
        f"trainer={strategy}",
        "trainer.accelerator=cpu",
        "data.batch_size=16",
        "model.optimizer.lr=1e12",
    ]
    proc = train(tmp_path, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: diverged in epoch 0, between steps "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "died" not in proc.stderr
    assert "srun` command is available" not in proc.stderr and "LeafSpec" not in proc.stderr
    said = proc.stderr + "".join(line for line in proc.stdout.splitlines(True) if not line.startswith(("│", "├", "└")))
    assert "sync_batchnorm" not in said  # trainer=ddp's default (the config tree shows it), which no BatchNorm misses
    (run,) = run_dirs(tmp_path / "logs")
    fit = json.loads((run / "fit_metrics.json").read_text())
    assert fit["status"] == "diverged", fit
    assert (run / "train.log").read_text().splitlines()[-1].endswith(f"[ERROR] - {errors[0]}")
    assert errors[0] in (run / "train_ddp_process_1.log").read_text()  # rank 1 says it in its own log


@pytest.mark.parametrize("trainer", ["single", "fsdp"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, trainer):
    extra = ["trainer=fsdp", "trainer.accelerator=cpu", "data.batch_size=16"] if trainer == "fsdp" else []
    args = [*RUN, *extra, "+callbacks.save_probe._target_=probes.KillDuringSave"]
    killed = train(tmp_path / "killed", *args, env={"KILL_ON_SAVE": "2"}, check=False)
    assert killed.returncode != 0
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    # the first save (step 3) is whole; the second was cut off while it was being written
    resumed = train(tmp_path / "resumed", *args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr


def test_resuming_with_more_epochs_is_refused_or_stretches_the_schedule(tmp_path):
    import csv

    base = [a for a in RUN if not a.startswith(("trainer.max_epochs", "logger="))] + ["logger=csv"]
    train(tmp_path / "first", *base, "trainer.max_epochs=2")
    (run,) = run_dirs(tmp_path / "first" / "logs")
    last = run / "checkpoints" / "last.ckpt"
    refused = train(tmp_path / "refused", *base, "trainer.max_epochs=4", f"ckpt_path={last}", check=False)
    assert refused.returncode == 2
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert "follows a schedule of T_max=2 epochs and this run asks for 4" in line and "stretch_schedule=true" in line
    train(tmp_path / "stretched", *base, "trainer.max_epochs=4", f"ckpt_path={last}", "stretch_schedule=true")
    (stretched,) = run_dirs(tmp_path / "stretched" / "logs")
    with open(stretched / "csv" / "metrics.csv") as f:
        # logged at each epoch's start, by step: 8 steps per epoch
        lrs = {int(row["step"]) // 8: float(row["lr-Adam"]) for row in csv.DictReader(f) if row.get("lr-Adam")}
    # the cosine of 4 epochs from 0.002, at epochs 2 and 3 (the old 2-epoch schedule had reached 0)
    for epoch in (2, 3):
        assert lrs[epoch] == pytest.approx(0.002 * (1 + math.cos(math.pi * epoch / 4)) / 2, rel=1e-6)


def test_the_command_to_continue_keeps_the_runs_settings_and_leaves_out_what_a_resume_refuses(monkeypatch):
    """A plain run's stop line gives `python train.py <its overrides> ckpt_path=...`, without its output folders (a
    resume writes into a new run dir, and refuses a folder holding the run's checkpoints), an earlier ckpt_path and
    the profile $PROJECT_PROFILE adds. A sweep's job, a tuned run and a run torchrun or SLURM started get the
    checkpoint to add to their own command."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from engine.launch import environment
    from engine.runs.continuing import continue_command

    def command(*overrides: str, mode: RunMode = RunMode.RUN, **env: str) -> str:
        runtime = SimpleNamespace(output_dir="/nowhere")  # a tuned run's tune.json is not there: test_tune.py has one
        hydra = SimpleNamespace(mode=mode, overrides=SimpleNamespace(task=list(overrides)), runtime=runtime)
        monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
        monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
        for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "NODE_RANK", "PROJECT_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        launched = [name for name in env if name != "PROJECT_PROFILE"]
        monkeypatch.setattr(environment, "_LAUNCHED_BY", launched)  # as the process found them at its start
        return continue_command("/runs/a b/last.ckpt")

    run = ["model=mlp", "logger=[tensorboard,mlflow]", "paths.output_dir=/out", "callbacks.last_checkpoint.dirpath=/ck"]
    said = command(
        *run, "ckpt_path=/old.ckpt", "profile=tiny", "+trainer.limit_train_batches=8", PROJECT_PROFILE="tiny"
    )
    assert shlex.split(said) == [
        "python", "train.py", "model=mlp", "logger=[tensorboard,mlflow]", "+trainer.limit_train_batches=8",
        "ckpt_path='/runs/a b/last.ckpt'",  # Hydra's quotes inside the shell's: the space would split it
    ]  # fmt: skip
    assert "profile=tiny" in command("model=mlp", "profile=tiny")  # chosen on the command line: kept
    added = "ckpt_path='/runs/a b/last.ckpt' added to the run's command"
    assert command("model=mlp", mode=RunMode.MULTIRUN) == added
    assert command("model=mlp", "tune=lr", "tune.apply=true") == added
    assert command("model=mlp", SLURM_JOB_ID="7") == command("model=mlp", TORCHELASTIC_RUN_ID="x") == added
    assert command("model=mlp", NODE_RANK="1") == added  # nodes started by hand: each adds it to its own command
