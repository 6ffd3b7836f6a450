"""Full disks under a tracker's store or a study's storage, mid-run: a real tmpfs, in a namespace of the test's own."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_service_failures import NOT_SAID, TINY, probe, said


def unshare_works() -> bool:
    try:
        done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not shutil.which("unshare") or not unshare_works(), reason="needs `unshare -rm` (user and mount namespaces)"
)


def in_a_namespace(cwd: Path, script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`sh -c script sh args...` in a user and mount namespace of its own, where it can mount a tmpfs: a disk of a
    few MiB, to fill up."""
    command = ["unshare", "-rm", "sh", "-c", script, "sh", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@needs_namespaces
def test_a_full_disk_under_the_mlflow_store_mid_run_leaves_the_run_going(tmp_path):
    """The store (sqlite file and artifacts) on a disk that fills up as epoch 1 starts: one warning line, no SQL,
    and the run ends as it would have, with every file of its own. Before: a traceback, no fit_metrics.json."""
    from conftest import REPO, cli_env, run_dirs

    store = tmp_path / "store"
    store.mkdir()
    args = [
        "logger=mlflow",
        f"logger.mlflow.tracking_uri=sqlite:///{store}/mlflow.db",
        probe("FillDiskAt"),
    ]
    script = f'mount -t tmpfs -o size=8m tmpfs "{store}" && exec "{sys.executable}" "{REPO}/train.py" "$@"'
    env = cli_env(**TINY, FILL_DIR=str(store), FILL_AT_EPOCH="1")
    proc = in_a_namespace(tmp_path, script, args, env)
    lines = said(proc)
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("warning: logger.mlflow: ") and "the run goes on without MLflow" in lines[0]
    assert "disk is full" in lines[0] or "No space left" in lines[0], lines[0]
    assert "[SQL" not in lines[0] and "INSERT" not in lines[0]
    (run,) = run_dirs(tmp_path / "logs")
    assert "val/acc" in json.loads((run / "fit_metrics.json").read_text())
    assert (run / "test_metrics.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file()


SEARCH = ["-m", "hparams_search=digits_optuna"]


def study_on_its_own_disk(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder for the study's database (a tmpfs is mounted there) and the search command, with the disk filler."""
    from conftest import REPO

    store = tmp_path / "store"
    store.mkdir()
    storage = f"hydra.sweeper.storage=sqlite:///{store}/optuna.db"
    return store, [sys.executable, str(REPO / "train.py"), *SEARCH, storage, probe("FillDiskAt")]


@pytest.mark.slow
@needs_namespaces
def test_a_full_disk_under_a_study_refuses_the_sweep_and_leaves_nothing(tmp_path):
    """logs/ on a disk that is full before the sweep starts: one line, and no lock, no database, no sweep dir left.
    Before: tracebacks (the lock's flush), an empty sweep dir and a 0-byte lock."""
    from conftest import REPO, cli_env

    (tmp_path / "logs").mkdir()
    script = (
        f'mount -t tmpfs -o size=1m tmpfs logs && "{sys.executable}" -c "import service_probes as t, pathlib; '
        f't.fill(pathlib.Path(\'logs\'))" && "{sys.executable}" "{REPO}/train.py" "$@"; code=$?; '
        "find logs -mindepth 1 > left.txt; exit $code"
    )
    proc = in_a_namespace(tmp_path, script, SEARCH, cli_env(**TINY))
    lines = said(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    # the sweep's directory is claimed first (engine.runs.dirs), on the same full disk
    assert lines[0].startswith(f"error: hydra.sweep.dir={tmp_path}/logs/train/multiruns/"), lines[0]
    assert "No space left on device" in lines[0] and "make room there" in lines[0], lines[0]
    assert (tmp_path / "left.txt").read_text().split() == ["logs/filler"]


@pytest.mark.slow
@needs_namespaces
def test_a_full_disk_under_a_study_mid_sweep_stops_it_and_the_same_command_continues(tmp_path):
    """The study's disk fills up as the job of trial 1 ends, before the sweep records its result: one line, the
    jobs' dirs kept, no lock left; room made, the same command continues the study (trial 1 again, then 2).
    Before: StorageInternalError's traceback."""
    from conftest import cli_env

    store, command = study_on_its_own_disk(tmp_path)
    study = (
        "import json, optuna; s = optuna.load_study(study_name=optuna.get_all_study_names(S)[0], storage=S); "
        "print(json.dumps([[t.number, t.state.name, t.user_attrs.get('interrupted', False)] for t in s.trials]))"
    )
    script = (
        f'mount -t tmpfs -o size=2m tmpfs "{store}" && {{ FILL_AT_TRIAL=1 "$@" 2> first.err; echo $? > first.rc; '
        f'find "{store}" -mindepth 1 -name ".*" > left.txt; rm "{store}/filler"; "$@" 2> second.err; '
        f'echo $? > second.rc; "{sys.executable}" -c "S = \'sqlite:///{store}/optuna.db\'; {study}" > trials.json; }}'
    )
    env = cli_env(**TINY, FILL_DIR=str(store))
    in_a_namespace(tmp_path, script, command, env)
    first = [line for line in (tmp_path / "first.err").read_text().splitlines() if line.strip()]
    first = [line for line in first if not any(n in line for n in NOT_SAID)]
    assert (tmp_path / "first.rc").read_text().strip() == "2" and len(first) == 1, first
    assert first[0].startswith(f"error: hydra.sweeper.storage=sqlite:///{store}/optuna.db: cannot be written (")
    assert "disk is full" in first[0] and "run the same command again" in first[0], first[0]
    assert "[SQL" not in first[0]
    (sweep, second_sweep) = sorted((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert [p.name for p in sorted(sweep.iterdir()) if p.is_dir()] == ["0", "1"]
    assert all((sweep / job / "fit_metrics.json").is_file() for job in ("0", "1"))
    assert (tmp_path / "left.txt").read_text() == ""  # no lock file beside the study
    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-3000:]
    trials = json.loads((tmp_path / "trials.json").read_text())
    assert [t for t in trials if t[2]] == [[1, "FAIL", True]]  # trial 1, told nothing: interrupted, run again
    assert sum(1 for t in trials if not t[2] and t[1] in ("COMPLETE", "PRUNED")) == 3


@pytest.mark.slow
@needs_namespaces
def test_a_full_disk_under_a_study_as_a_job_reports_to_the_pruner_is_one_line(tmp_path):
    """The disk fills as trial 1's second epoch starts: the pruner's report at its validation cannot be written."""
    from conftest import cli_env

    store, command = study_on_its_own_disk(tmp_path)
    script = (
        f'mount -t tmpfs -o size=2m tmpfs "{store}" && FILL_AT_TRIAL=1 FILL_AT_EPOCH=1 "$@"; echo $? > first.rc; '
        f'rm "{store}/filler" && "$@" 2> second.err; echo $? > second.rc'
    )
    proc = in_a_namespace(tmp_path, script, command, cli_env(**TINY, FILL_DIR=str(store)))
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not any(n in line for n in NOT_SAID)]
    assert (tmp_path / "first.rc").read_text().strip() == "2" and len(lines) == 1, proc.stderr[-3000:]
    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-3000:]
    assert lines[0].startswith(f"error: hydra.sweeper.storage=sqlite:///{store}/optuna.db: cannot be written (")
    assert "disk is full" in lines[0] and "run the same command again" in lines[0], lines[0]
