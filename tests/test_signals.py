"""Signals: SIGTERM, SIGINT and SIGUSR1 save last.ckpt and exit 128 + the signal, on one process and on every ddp
rank at the same step, whenever they come (set-up, a step, validation, an epoch's last batch, the test); Ctrl-C
outside a run is one line; a sweep's next job starts with the handlers the sweep had."""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, WARM, cli_env, run_dirs, run_python
from test_fault_tolerance import RUN, train

pytestmark = pytest.mark.slow


def start(cwd: Path, *args: str, env: dict) -> subprocess.Popen:
    """`python train.py <args>` in the background, warm (tests/warm.py: signals reach the run, its exit code or
    signal comes back)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [str(WARM.python_on_path() / "python"), str(REPO / "train.py"), *args],
        cwd=cwd,
        env=cli_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and path.read_text():
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


# SIGUSR1 (138) outside SLURM's requeue: tests/test_slurm.py, the submitit job
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_writes_the_metrics_and_exits_non_zero(tmp_path, sig, code):
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = start(tmp_path / "work", *RUN, env={"PROBE_DIR": str(probe), "STEP_SLEEP": "0.3"})
    os.kill(int(wait_for(probe / "pid_0")), sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-2000:]
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith(f"stopped by {sig.name} at epoch 0, step ")
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "interrupted"
    ckpt = line.split("ckpt_path=")[1]
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] >= 1
    # the command to continue holds the run's own overrides: a resume with other settings is refused
    command = shlex.split(line.split("continue with: ")[1])
    assert command == ["python", "train.py", *RUN, f"ckpt_path={ckpt}"], line
    if sig == signal.SIGTERM:  # the saved checkpoint continues (the same for every signal: one is enough)
        assert train(tmp_path / "resumed", *command[2:]).returncode == 0


def test_a_signal_found_on_an_epochs_last_batch_waits_for_its_validation_and_checkpoints(tmp_path):
    """An agreement on an epoch's last batch comes before that epoch's validation: stopping there saved a last.ckpt
    from which a resume skips the validation (the epoch never competed for the best file). The signal now waits for
    the epoch's end, as one found during validation does."""
    # the agreement lands on the last of the epoch's 8 batches
    run_args = [*RUN, "callbacks.run_checks.every_n_steps=8"]
    stopped = train(tmp_path / "work", *run_args, env={"KILL_AT_STEP": "7", "KILL_SIGNAL": "SIGTERM"}, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert line.startswith("stopped by SIGTERM at epoch 0, step 8:"), line
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
    fit = json.loads((run / "fit_metrics.json").read_text())
    assert fit["status"] == "interrupted" and fit["val/acc"] is not None, fit
    assert fit["best/val/acc"] == fit["val/acc"]  # the best so far, as a finished fit records it (the summary's column)


def test_a_signal_between_training_steps_is_honoured(tmp_path):
    """During the last validation: the run saves and stops before test; during test: the test stops. Both 143."""
    run_args = [*RUN[:-1], "+callbacks.probe._target_=probes.SignalAt", "test=true"]
    stopped = train(tmp_path / "val", *run_args, env={"SIGNAL_AT": "last_validation"}, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert line.startswith("stopped by SIGTERM at epoch 2, step 24:"), line
    (run,) = run_dirs(tmp_path / "val" / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "interrupted"
    assert not (run / "test_metrics.json").exists()
    ckpt = line.split("ckpt_path=")[1]
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 24
    resumed = train(tmp_path / "resumed", *run_args, f"ckpt_path={ckpt}")
    (again,) = run_dirs(tmp_path / "resumed" / "logs")
    assert json.loads((again / "test_metrics.json").read_text())["status"] == "ok", resumed.stderr[-2000:]

    stopped = train(tmp_path / "test", *run_args, env={"SIGNAL_AT": "test"}, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert line == "stopped by SIGTERM during test: training had finished; test it again with eval.py"
    (run,) = run_dirs(tmp_path / "test" / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"
    assert json.loads((run / "test_metrics.json").read_text())["status"] == "interrupted"

    # eval.py trained nothing: its test is what to run again
    best = next((run / "checkpoints").glob("epoch_*.ckpt"))
    evaluate = [sys.executable, str(REPO / "eval.py"), f"ckpt_path={best}", "+callbacks.probe._target_=probes.SignalAt"]
    stopped = run_python(evaluate, tmp_path / "test", cli_env(SIGNAL_AT="test"))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert line == "stopped by SIGTERM during test: test again with the same command"


@pytest.mark.parametrize("last_checkpoint", [True, False])
def test_a_signal_during_validation_stops_the_run_after_that_epochs_checkpoints(tmp_path, last_checkpoint):
    """The epoch's best file is saved before the run stops (the stop came before the checkpoint callbacks, and the
    epoch's best file was lost), and last.ckpt, the one the run continues from, knows it as its best. Without the
    last.ckpt callback the stop saves it itself, at the epoch's end."""
    run_args = [*RUN[:-2], "+callbacks.probe._target_=probes.SignalAt"]
    if not last_checkpoint:
        run_args.append("~callbacks.last_checkpoint")
    stopped = train(tmp_path / "val", *run_args, env={"SIGNAL_AT": "first_validation"}, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert line.startswith("stopped by SIGTERM at epoch 0, step 8:"), line
    (run,) = run_dirs(tmp_path / "val" / "logs")
    assert (run / "train.log").read_text().splitlines()[-1].endswith(f"[ERROR] - {line}")  # how the run ended
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 8 and last["epoch"] == 0
    (best,) = [state for key, state in last["callbacks"].items() if key.startswith("ModelCheckpoint{'monitor': 'val/")]
    assert Path(best["best_model_path"]).name == ("epoch_000.ckpt" if last_checkpoint else "")  # saved before it
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "interrupted"


def test_sigterm_to_one_ddp_rank_stops_every_rank_without_a_hang(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    proc = start(tmp_path / "work", *ddp, env={"PROBE_DIR": str(probe), "STEP_SLEEP": "0.3"})
    os.kill(int(wait_for(probe / "pid_1")), signal.SIGTERM)  # not the rank Lightning's handler broadcasts from
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_to_one_ddp_rank_before_training_starts_stops_every_rank(tmp_path, rank):
    """A signal during the set-up (the sanity check, a compile) was agreed on at the start of training by the rank
    that had it alone: a collective the other rank never made (gloo aborted: "Received data size doesn't match")."""
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    env = {"KILL_AT_HOOK": "on_sanity_check_start", "KILL_RANK": str(rank), "KILL_SIGNAL": "SIGTERM"}
    (tmp_path / "work").mkdir()
    argv = [sys.executable, str(REPO / "train.py"), *ddp]
    proc = run_python(argv, tmp_path / "work", cli_env(**env), timeout=120)  # it hung: the ranks wait on each other
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM at epoch 0, step 0: saved ")
    # the command that continues it is train.py's own (Lightning's launcher sets NODE_RANK in rank 0 as it starts
    # the others: taken for nodes started by hand, it said only `ckpt_path=... added to the run's command`)
    assert "; continue with: python train.py seed=1 " in proc.stderr.strip().splitlines()[-1]
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 0


def test_sigterm_to_one_ddp_rank_during_the_test_stops_the_test(tmp_path):
    """The ranks agreed on a signal every every_n_steps test batches: a test set shorter than that ran to its end, and
    the run exited 0 as if no signal had come."""
    tested = [arg for arg in RUN if arg != "test=false"]
    ddp = [*tested, "+trainer.limit_test_batches=2", "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    env = {"KILL_AT_HOOK": "on_test_batch_start", "KILL_RANK": "1", "KILL_SIGNAL": "SIGTERM"}
    (tmp_path / "work").mkdir()
    argv = [sys.executable, str(REPO / "train.py"), *ddp]
    proc = run_python(argv, tmp_path / "work", cli_env(**env), timeout=180)
    assert proc.returncode == 143, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line == "stopped by SIGTERM during test: training had finished; test it again with eval.py", line
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert json.loads((run / "test_metrics.json").read_text())["status"] == "interrupted"


def test_a_second_sigterm_ends_ranks_that_wait_on_each_other_at_once(tmp_path):
    """Ranks blocked in a collective (a rank that never joins: unequal batch counts under fsdp) run no Python signal
    handler: every SIGTERM was ignored until gloo's 30-minute timeout. The first is still the run's to act on."""
    probe = tmp_path / "probe"
    probe.mkdir()
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "data.batch_size=16"]
    proc = start(tmp_path / "work", *ddp, env={"PROBE_DIR": str(probe), "HANG_AT_STEP": "2"})
    wait_for(probe / "hanging")
    pids = [int(wait_for(probe / f"pid_{rank}")) for rank in (0, 1)]
    time.sleep(1)  # rank 0 is in the step's all-reduce by now
    for pid in pids:  # as a terminal's Ctrl-C, or scancel, reaches every rank
        os.kill(pid, signal.SIGTERM)
    time.sleep(2)
    assert proc.poll() is None  # the first is not acted on while the ranks wait
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-2000:]
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("stopped at once by a second SIGTERM: "), line
    time.sleep(1)
    for pid in pids:  # no rank is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


SIGNALLED = """
import os, signal, sys, time
from engine.launch import second_signal

signal.signal(signal.SIGTERM, lambda *args: None)  # a run's own handler: it records the signal and goes on
with second_signal.armed():
    pid = os.fork() if sys.argv[1] == "fork" else 0
    if pid == 0 and sys.argv[1] == "fork":  # a DataLoader's forked worker, with its parent's handlers
        time.sleep(10)
        os._exit(0)
    target = pid or os.getpid()
    os.kill(target, signal.SIGTERM)
    time.sleep(float(sys.argv[2]))
    os.kill(target, signal.SIGTERM)
    time.sleep(1)
    if pid:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
print("went on")
"""


@pytest.mark.parametrize(
    ("who", "apart_s", "ended"),
    [("self", "1.5", True), ("self", "0.01", False), ("fork", "1.5", False)],
    ids=["a-second-signal-ends-it", "the-same-signal-twice-at-once-is-one", "a-forked-childs-signals-are-its-own"],
)
def test_a_second_stop_signal_a_second_after_the_first_ends_the_process(who, apart_s, ended):
    proc = subprocess.run(
        [sys.executable, "-c", SIGNALLED, who, apart_s], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    if ended:
        assert proc.returncode == 143, proc.stderr
        assert proc.stderr.startswith("stopped at once by a second SIGTERM: "), proc.stderr
    else:
        assert (proc.returncode, proc.stdout) == (0, "went on\n"), proc.stderr


def test_ctrl_c_outside_a_run_is_one_line_and_exit_130():
    """Between a sequential sweep's jobs no run's handler is installed: Hydra's loop got a KeyboardInterrupt, and the
    sweep ended in a 49-line traceback."""
    script = "from engine.entry import cli\n\ndef main():\n    raise KeyboardInterrupt\n\ncli(main)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "stopped by SIGINT\n")


def test_a_resumed_run_signalled_before_training_starts_stops_with_its_checkpoint(tmp_path):
    """A last.ckpt saved inside a step's end hooks resumes with that step processed but not completed: a stop at the
    start of training took it for a step cut short, and Lightning's logger connector failed an assertion."""
    killed = train(tmp_path / "killed", *RUN, env={"KILL_AT_STEP": "5"}, check=False)
    assert killed.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path / "killed" / "logs")
    env = {"KILL_AT_HOOK": "on_fit_start", "KILL_SIGNAL": "SIGTERM"}
    last = run / "checkpoints" / "last.ckpt"
    stopped = train(tmp_path / "resumed", *RUN, f"ckpt_path={last}", env=env, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM at epoch 0, step 3: saved ")


def test_the_jobs_of_a_sequential_sweep_start_with_the_signal_handlers_the_sweep_had(tmp_path):
    """A run's handlers only record a signal for it to act on: the job after it had them still, so a Ctrl-C before
    its own were installed went to a run that was over, and was lost."""
    probe = tmp_path / "probe"
    probe.mkdir()
    args = [
        "-m",
        "seed=1,2",
        "model=mlp",
        "test=false",
        "logger=none",
        "+callbacks.handlers._target_=probes.SignalHandlers",
    ]
    train(tmp_path / "work", *args, env={"PROJECT_PROFILE": "tiny", "PROBE_DIR": str(probe)})
    first, second = ((probe / f"handlers_{job}.txt").read_text() for job in (0, 1))
    assert first == second and "RunChecks" not in second, (first, second)


def test_a_signal_to_ddp_spawns_main_process_stops_its_workers_as_under_ddp(tmp_path):
    """`kill <pid>` of the process the user started: it ended at once, and its workers then stopped on their own,
    without a checkpoint or a line. The main process now passes the signal to its workers."""
    probe = tmp_path / "probe"
    probe.mkdir()
    args = [*RUN, "trainer=ddp_spawn", "trainer.accelerator=cpu", "data.batch_size=16"]
    proc = start(tmp_path / "work", *args, env={"PROBE_DIR": str(probe), "STEP_SLEEP": "0.3"})
    workers = [int(wait_for(probe / f"pid_{rank}")) for rank in (0, 1)]
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("stopped by SIGTERM at epoch 0, step ") and "Traceback" not in stderr, stderr[-3000:]
    ckpt = line.split("ckpt_path=")[1]
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] >= 1
    # the workers, given the run's Hydra config, say the whole command (they could not: exit 1 and a traceback)
    assert shlex.split(line.split("continue with: ")[1]) == ["python", "train.py", *args, f"ckpt_path={ckpt}"]
    (run,) = run_dirs(tmp_path / "work" / "logs")
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "interrupted"
    for pid in workers:  # none left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_signal_to_ddp_spawns_main_process_as_its_workers_start_ends_the_run_in_one_line(tmp_path):
    """Passed on before a worker had the run's handlers, it ended that worker (-15), and the main process took that
    for a failure: torch's ProcessExitedException traceback, exit 1."""
    probe = tmp_path / "probe"
    probe.mkdir()
    args = [*RUN, "trainer=ddp_spawn", "trainer.accelerator=cpu", "data._target_=probes.SlowSetupDigits"]
    proc = start(tmp_path / "work", *args, env={"PROBE_DIR": str(probe)})
    wait_for(probe / "setup_0")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    said = stderr.strip().splitlines()[-1]
    assert said == "stopped by SIGTERM while the workers started: nothing was trained, nothing saved", said


def test_the_command_to_continue_quotes_a_path_that_hydra_would_split():
    """A run under a folder with a space printed `'ckpt_path=/tmp/spa ce/.../last.ckpt'`: quoted for the shell, but
    Hydra's grammar then split it ("LexerNoViableAltException"), so the command to continue did not run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from engine.runs.continuing import resume_override

    parser = OverridesParser.create()
    alone = [f"/tmp/a{char}b/last.ckpt" for char in " ,=[]{}()'\"\\$*?:;|&<>#~!^`ü数"]  # each special one by itself
    for path in ["/tmp/plain/last.ckpt", "/tmp/spa ce/ünï 数字/it's [1],x=y\\z\\'/last.ckpt", "/tmp/a b\\", *alone]:
        (pasted,) = shlex.split(shlex.quote(resume_override(path)))  # through the shell, as the stop line prints it
        (override,) = parser.parse_overrides([pasted])
        assert override.key_or_group == "ckpt_path" and override.value() == path, path
    assert resume_override("/tmp/plain/last.ckpt") == "ckpt_path=/tmp/plain/last.ckpt"


def test_a_sweep_that_a_signal_stops_writes_its_summary(tmp_path):
    """It ended without Hydra's end-of-sweep callbacks: no summary.md, and nothing said of the jobs not started."""
    env = {"KILL_AT_STEP": "2", "KILL_SIGNAL": "SIGTERM"}  # the first job stops the sweep
    proc = train(tmp_path, "-m", *RUN, "seed=1,2,3", env=env, check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    said = proc.stderr.strip().splitlines()
    assert said[-1] == f"sweep stopped, 2 of 3 jobs not started; summary: {sweep / 'summary.md'}", said
    assert said[-2].startswith("stopped by SIGTERM at epoch 0, step ")
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 4 and sum("not started" in row for row in rows) == 2 and "interrupted" in rows[1], rows
