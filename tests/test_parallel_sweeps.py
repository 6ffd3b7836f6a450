"""Parallel sweeps (hydra/launcher=parallel): one slot per worker process, its own GPUs or CPU cores; an Optuna
search keeps every worker busy, one trial after the other, never a batch.

GPU pinning is not run on a GPU here: the GPU ids come from CUDA_VISIBLE_DEVICES, set by the tests."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from conftest import REPO, cli_env

from engine.sweeps.device_slots import share, visible_gpus

CLAIM = "from pathlib import Path; from engine.sweeps.device_slots import claim_slot; import sys, time; "


def test_each_process_holds_the_first_free_slot_until_it_ends(tmp_path):
    hold = subprocess.Popen(
        [sys.executable, "-c", CLAIM + f"print(claim_slot(2, Path('{tmp_path}')), flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    assert hold.stdout is not None and hold.stdout.readline().strip() == "0"
    claim = [
        sys.executable,
        "-c",
        CLAIM + f"print(claim_slot(2, Path('{tmp_path}')), claim_slot(2, Path('{tmp_path}')))",
    ]
    assert subprocess.run(claim, capture_output=True, text=True, env=cli_env()).stdout.split() == ["1", "1"]
    hold.kill()
    hold.wait()
    time.sleep(0.1)
    assert subprocess.run(claim, capture_output=True, text=True, env=cli_env()).stdout.split() == ["0", "0"]


def test_slots_split_gpus_round_robin_and_cores_in_blocks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpus = visible_gpus()
    assert [share(gpus, slot, 4, interleave=True) for slot in range(4)] == [["4"], ["5"], ["6"], ["7"]]
    assert [share(gpus, slot, 2, interleave=True) for slot in range(2)] == [["4", "6"], ["5", "7"]]
    assert [share(list(range(16)), slot, 4, interleave=False) for slot in range(4)][1] == [4, 5, 6, 7]
    assert [share([0, 1], slot, 3, interleave=False) for slot in range(3)] == [[0], [1], [0]]  # never empty


@pytest.mark.slow
def test_parallel_workers_get_their_own_cores_and_more_jobs_than_gpus_are_refused(cli, tmp_path):
    proc = cli("train.py", "-m", "hydra/launcher=parallel", "model=mlp", "seed=1,2,3", env={"PROJECT_PROFILE": "tiny"})
    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    pins = {}
    for job in ("0", "1", "2"):
        text = (root / job / "train.log").read_text()
        (line,) = re.findall(r"device slot (\d) of 2 \(pid (\d+)\): GPUs none, CPU cores ([\d,]+)", text)
        pins[job] = line
        assert (root / job / "test_metrics.json").is_file()
    assert {pins["0"][0], pins["1"][0]} == {"0", "1"} and pins["0"][1] != pins["1"][1]  # two workers, two slots
    assert pins["2"] in (pins["0"], pins["1"])  # a reused worker keeps its slot and cores
    assert len({p[2] for p in pins.values()}) == 2  # one core each on 2 cores
    assert (root / "summary.csv").is_file() and "error" not in proc.stderr
    assert "deprecated" not in proc.stderr  # the workers ignore the warnings the command line's process ignores

    refused = cli(
        "train.py", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=3", "seed=1,2,3",
        env={"CUDA_VISIBLE_DEVICES": "0,1"}, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr == "error: hydra.launcher.n_jobs=3: only 2 GPUs; run at most one job per GPU\n"


def span(job: Path) -> tuple[float, float]:
    """When a sweep job ran: its saved config (written as it starts) to its newest file."""
    start = (job / ".hydra" / "config.yaml").stat().st_mtime
    return start, max(p.stat().st_mtime for p in job.rglob("*") if p.is_file())


@pytest.mark.slow
def test_an_optuna_search_starts_the_next_trial_as_soon_as_a_worker_is_free(cli, tmp_path):
    """Trial 0 is long (pruned after 5 epochs), the others take one epoch (trial 2 fails at once): with batches of
    2, trial 2 could start only once trial 0 ended. The trials are queued in the study first, so their order and
    parameters are known; a user's own net (tests/user_models.py) is trained."""
    storage = f"sqlite:///{tmp_path}/logs/optuna.db"
    (tmp_path / "logs").mkdir()
    queued = optuna.create_study(study_name="long_and_short", storage=storage, direction="maximize")
    for epochs, lr in ((20, 0.001), (1, 0.001), (1, -1.0), (1, 0.001)):
        queued.enqueue_trial({"trainer.max_epochs": epochs, "model.optimizer.lr": lr})
    proc = cli(
        "train.py", "-m", "hparams_search=digits_optuna", "hydra/launcher=parallel",
        "hydra.sweeper.study_name=long_and_short", "hydra.sweeper.n_trials=4", "hydra.sweeper.params=null",
        "trainer.max_epochs=choice(1,20)", "model.optimizer.lr=choice(-1.0,0.001)",  # -1: the job fails
        "trainer.limit_train_batches=30", "~model.net", "+model.net._target_=user_models.ResidualNet",
        "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner", "~hydra.sweeper.pruner.n_startup_trials",
        "+hydra.sweeper.pruner.lower=1.01", "hydra.sweeper.pruner.n_warmup_steps=4",  # prunes after 5 epochs
        env={"PROJECT_PROFILE": "tiny"}, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "2 trials at a time: the next one starts as soon as any of them ends" in proc.stdout + proc.stderr
    trials = optuna.load_study(study_name="long_and_short", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["PRUNED", "COMPLETE", "FAIL", "COMPLETE"]  # n_trials, nothing more
    assert list(trials[0].intermediate_values) == list(range(5))  # the pruner, judging in the workers
    assert trials[2].user_attrs["error"] == "model.optimizer: ValueError: Invalid learning rate: -1.0"

    (root,) = (tmp_path / "logs" / "train" / "multiruns").glob("*")
    assert sorted(p.name for p in root.iterdir() if (p / ".hydra").is_dir()) == ["0", "1", "2", "3"]
    (start_long, end_long), (_, end_first_short) = span(root / "0"), span(root / "1")
    later = {n: span(root / n)[0] for n in ("2", "3")}
    # a worker took trial 2 when trial 1 ended, while trial 0 still ran: impossible with batches of 2
    assert end_first_short < later["2"] < end_long and start_long < later["2"]
    assert trials[2].datetime_start < trials[0].datetime_complete  # the study asked for it then, too

    rows = {r["job"]: r for r in csv.DictReader((root / "summary.csv").open())}
    assert [rows[n]["status"] for n in "0123"] == ["pruned", "ok", "failed", "ok"]
    assert rows["0"]["epochs"] == "5" and rows["1"]["epochs"] == "1"
    assert (root / "2" / "error.txt").read_text().startswith("model.optimizer: ValueError: Invalid learning rate")
    lines = proc.stderr.strip().splitlines()
    assert "error: sweep job 2 (" in proc.stderr and "Traceback" not in proc.stderr
    assert lines[-1] == f"error: 1 of 4 sweep jobs failed; see {root}/<job>/error.txt"


def _worker_running(job: Path) -> int | None:
    """The pid of the joblib worker process whose job writes into `job` (its open train.log)."""
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if fd.readlink() == job / "train.log" and "loky" in (fd.parents[1] / "cmdline").read_text():
                return int(fd.parents[1].name)
        except OSError:  # a process or descriptor that went away meanwhile
            continue
    return None


@pytest.mark.slow
def test_a_killed_worker_fails_its_trials_and_ctrl_c_leaves_the_search_to_resume(tmp_path):
    """kill -9 of the worker running trial 0: joblib stops its whole pool, so the trials running then fail with that
    reason and the search goes on with new workers; Ctrl-C then ends it as it ends a single run (exit 130), the
    trials it cut off queued to run again first."""
    command = [
        sys.executable, str(REPO / "train.py"), "-m", "hparams_search=digits_optuna", "hydra/launcher=parallel",
        "hydra.sweeper.n_trials=8", "trainer.limit_train_batches=200", "~model.net",
        "+model.net._target_=user_models.TutorialCNN",  # no `hidden`: its space is the learning rate alone
        "hydra.sweeper.params=null", "model.optimizer.lr=tag(log, interval(1e-4, 1e-2))",
    ]  # fmt: skip
    sweep = subprocess.Popen(
        command, cwd=tmp_path, env=cli_env(PROJECT_PROFILE="tiny"), stderr=subprocess.PIPE, text=True,
        stdout=subprocess.DEVNULL, start_new_session=True,  # its own process group, as a terminal gives it
    )  # fmt: skip
    multiruns = tmp_path / "logs" / "train" / "multiruns"

    def wait_for(found, what: str):
        deadline = time.time() + 120
        while not (result := found()):
            assert sweep.poll() is None and time.time() < deadline, f"no {what}: {sweep.communicate()[1][-3000:]}"
            time.sleep(0.2)
        return result

    root = wait_for(lambda: next(multiruns.glob("*"), None), "sweep dir")
    os.kill(wait_for(lambda: _worker_running(root / "0"), "worker running trial 0"), signal.SIGKILL)
    wait_for(lambda: list(root.glob("[2-9]/.hydra")), "trial after the lost ones")  # new workers took them
    time.sleep(1)
    os.killpg(sweep.pid, signal.SIGINT)
    _, stderr = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, stderr[-3000:]
    # (joblib's resource tracker, in the same process group, may print a KeyError of its own after this line)
    cut = re.search(r"\nstopped by SIGINT: trials \[([\d, ]+)\] were cut off; the same command runs them again first\n",
                    stderr)  # fmt: skip
    assert cut and "Traceback" not in stderr[: cut.start()], stderr[-3000:]

    storage = f"sqlite:///{tmp_path}/logs/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials()
    lost = [t for t in trials if t.user_attrs.get("error", "").startswith("LostJob: ")]
    assert 0 in [t.number for t in lost] and all(t.state.name == "FAIL" for t in lost)
    reason = "LostJob: its worker process died, or was stopped with the pool when another worker died: Terminated"
    assert all(t.user_attrs["error"].startswith(reason) for t in lost)
    for trial in lost:  # a failed job as any other: its error.txt, and its line on stderr
        assert (root / str(trial.number) / "error.txt").read_text().startswith("LostJob: its worker process died")
        assert f"error: sweep job {trial.number}: LostJob: " in stderr
    # and at the end of the killed job's own log, as a job that records its failure itself writes it
    last = (root / "0" / "train.log").read_text().splitlines()[-1]
    logged = r"\[[\d :,-]+\]\[[\w.]+\]\[ERROR\] - error: sweep job 0: LostJob: its worker process died.*"
    assert re.fullmatch(logged, last), last
    interrupted = sorted(t.number for t in trials if t.user_attrs.get("interrupted"))
    assert interrupted == sorted(int(n) for n in cut.group(1).split(", "))
    queued = sorted(t.user_attrs["retry_of"] for t in trials if t.state.name == "WAITING")
    assert queued == interrupted  # they run again first when the same command continues the study


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_a_kill_9_of_the_sweep_stops_its_workers_jobs_as_a_sigterm_would(tmp_path):
    """The workers went on training their jobs (then waited minutes for work) after the sweep's process was killed;
    each now stops its job as a SIGTERM stops a run, with last.ckpt and the line to continue, and exits."""
    command = [
        sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=parallel", "model=mlp", "seed=1,2",
        "trainer.max_epochs=100000", "~callbacks.early_stopping",  # far longer than the test waits
    ]  # fmt: skip
    sweep = subprocess.Popen(
        command, cwd=tmp_path, env=cli_env(PROJECT_PROFILE="tiny"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    multiruns, deadline = tmp_path / "logs" / "train" / "multiruns", time.time() + 120
    workers: dict[str, int] = {}
    while len(workers) < 2 or not all(any(multiruns.glob(f"*/{job}/checkpoints/last.ckpt")) for job in workers):
        assert sweep.poll() is None and time.time() < deadline, "the sweep's two jobs did not start training"
        for job in ("0", "1"):
            found = next(multiruns.glob("*"), None)
            pid = _worker_running(found / job) if found is not None else None
            if pid is not None:
                workers[job] = pid
        time.sleep(0.2)
    (root,) = multiruns.glob("*")
    os.kill(sweep.pid, signal.SIGKILL)
    assert sweep.wait() == -signal.SIGKILL
    deadline = time.time() + 60
    while any(_alive(pid) for pid in workers.values()):
        assert time.time() < deadline, f"workers still running after the sweep's process was killed: {workers}"
        time.sleep(0.2)
    for job, pid in workers.items():
        log = (root / job / "train.log").read_text()
        assert f"the sweep's process (pid {sweep.pid}) is gone: worker {pid} stops its job" in log
        assert "stopped by SIGTERM" in log and (root / job / "checkpoints" / "last.ckpt").is_file()
        assert '"status": "interrupted"' in (root / job / "fit_metrics.json").read_text()
