"""A tracking server, a tracker's store or a study's storage that fails under a run: one line, in a bounded time,
never a hang, a traceback, SQL or HTML, and the run's own files kept (a tracker holds a copy: the run goes on without
it; a study's storage holds the search: the sweep stops, to be continued by the same command).

A full disk is a real one: a small tmpfs, mounted in a mount namespace of the test's own (`unshare -rm`, no root
needed), filled mid-run by a probe (`FillDiskAt`): tests/test_service_failures_disk.py. A tracking server is MLflow's
own (`mlflow server`), stopped mid-run with SIGSTOP by a probe (`SignalServiceAt`): it still accepts connections, and
never answers.

The probes are Lightning callbacks in tests/service_probes.py, which the runs add with
`+callbacks.<name>._target_=service_probes.<Probe>` (tests/ is on the runs' PYTHONPATH).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TINY = {"PROJECT_PROFILE": "tiny"}  # 2 epochs of 3 batches
# MLflow's and Optuna's notes as they make a new store or study (the former silenced by engine.loggers.mlflow since)
NOT_SAID = (" INFO mlflow.", "INFO  [alembic", "] A new study created in RDB with name: ")


# ---------------------------------------------------------------- helpers


def said(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines on stderr, less MLflow's own as it makes a new store."""
    return [line for line in proc.stderr.splitlines() if line.strip() and not any(n in line for n in NOT_SAID)]


def probe(name: str) -> str:
    return f"+callbacks.{name.lower()}._target_=service_probes.{name}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` on a store of its own, in a process group of its own (its workers stop with it)."""
    folder.mkdir(parents=True)
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
        "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.3)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------- error texts


def test_a_storages_error_is_one_readable_line_without_sql_or_html():
    """SQLAlchemy's errors carry their statement and parameters (MLflow and Optuna pass them on in their own), a web
    server's 404 its HTML page: the one line says what the store or server said, not those."""
    import sqlalchemy

    from engine.loggers import tracking

    engine = sqlalchemy.create_engine("sqlite://")
    with pytest.raises(sqlalchemy.exc.OperationalError) as raised, engine.connect() as connection:
        connection.execute(sqlalchemy.text("INSERT INTO runs (name, secret) VALUES (:n, :s)"), {"n": "x", "s": "pw"})
    assert tracking.one_line(raised.value) == "OperationalError: (sqlite3.OperationalError) no such table: runs"
    page = (
        "API request to endpoint /api/2.0/mlflow/runs/create failed with error code 404 != 200. Response body: "
        "'<!DOCTYPE HTML>\n<html>\n<head><title>404 Not Found</title><style>p {x: 1}</style></head>\n<body>\n"
        "<h1>Not Found</h1>\n<p>The requested URL was not found on this server &amp; nowhere else.</p>\n</body></html>'"
    )
    assert tracking.readable(page) == (
        "API request to endpoint /api/2.0/mlflow/runs/create failed with error code 404 != 200. Response body: "
        "' Not Found The requested URL was not found on this server & nowhere else. '"
    )
    retried = (  # urllib3's report of its last try: what happened is its cause
        "API request to http://h:5/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool(host='h', "
        'port=5): Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch (Caused by NewConnectionError("HTTP'
        "Connection(host='h', port=5): Failed to establish a new connection: [Errno 111] Connection refused\"))"
    )
    assert tracking.readable(retried) == (
        "API request to http://h:5/api/2.0/mlflow/runs/log-batch failed with exception NewConnectionError: Failed to "
        "establish a new connection: [Errno 111] Connection refused"
    )


@pytest.mark.slow
def test_a_web_server_that_is_not_mlflow_is_one_line_without_its_html(cli, tmp_path):
    """tracking_uri at a web server that answers every API request with its HTML 404 page: one line, no HTML."""
    import http.server

    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *args: None})
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    try:
        proc = cli("train.py", "logger=mlflow", f"logger.mlflow.tracking_uri={url}", env=TINY, check=False)
    finally:
        web.shutdown()
    (line,) = said(proc)
    assert proc.returncode == 2 and line.startswith(f"error: logger.mlflow: tracking_uri={url}: MlflowException: ")
    assert "404" in line and "File not found" in line and "<" not in line, line
    assert not list(tmp_path.glob("logs/train/runs/*"))


# ---------------------------------------------------------------- metric names


def test_a_metric_name_mlflow_refuses_or_merges_ends_the_run_at_its_first_log_naming_it(tmp_path):
    """MLflow takes names of at most 250 characters, and Lightning's logger drops the characters MLflow does not
    take, so that two names can become one: said at the first log, before anything is sent; a name that passes
    reaches the store."""
    from engine.errors import UserError
    from engine.loggers.mlflow import MLFlowLogger

    def logger(name: str) -> MLFlowLogger:
        return MLFlowLogger(f"sqlite:///{tmp_path}/mlflow.db", "names", str(tmp_path / name), resume=False)

    long = logger("long")
    with pytest.raises(UserError) as refused:
        long.log_metrics({"val/" + "x" * 302: 1.0}, step=0)
    assert str(refused.value) == (
        f"logger=mlflow: the metric {'val/' + 'x' * 56!r}... (306 characters) has a name of 306 characters in MLflow, "
        "which takes at most 250: log it under a shorter name"
    )
    long.finalize("failed")

    merged = logger("merged")
    merged.log_metrics({"val/acc%": 0.5, "val/loss": 1.0}, step=0)
    with pytest.raises(UserError) as refused:
        merged.log_metrics({"val/acc": 0.25}, step=1)  # a later log, or the same one: the same refusal
    assert str(refused.value) == (
        "logger=mlflow: the metrics 'val/acc%' and 'val/acc' would both be 'val/acc' in MLflow (it keeps only "
        "letters, digits and _ / . - and spaces in a name): log one of them under another name"
    )
    with pytest.raises(UserError, match="'a//b' would be 'a//b' in MLflow, which refuses it"):
        merged.log_metrics({"a//b": 1.0}, step=1)
    merged.finalize("success")
    history = merged.experiment.get_metric_history(merged.run_id, "val/acc")
    assert [(m.step, m.value) for m in history] == [(0, 0.5)]


@pytest.mark.slow
def test_a_metric_name_too_long_for_mlflow_is_one_line(cli, tmp_path):
    name = "train/" + "a" * 300
    env = {**TINY, "METRIC_NAMES": json.dumps([name])}
    proc = cli("train.py", "logger=mlflow", probe("LogNamed"), env=env, check=False)
    lines = said(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: logger=mlflow: the metric 'train/aaaa") and "306 characters" in lines[0]


# ---------------------------------------------------------------- a tracking server that dies mid-run


@pytest.mark.slow
def test_a_tracking_server_that_stops_answering_mid_run(tmp_path):
    """The server stops answering (SIGSTOP: connections are still accepted) as epoch 1 starts. The run does not wait
    for it: it trains on, says so in one warning line, ends as it would have (exit 0, every file of its own) within
    the bound of one request (REQUEST_LIMITS). A second run, whose server stops the same way, is stopped by SIGTERM
    at once, with its last.ckpt and the command to continue it. Before: 8.5 minutes of retries, SIGTERM ignored
    for 2 more, a traceback of 280 lines."""
    from conftest import REPO, WARM, cli_env, run_dirs, run_python

    with mlflow_server(tmp_path / "server") as (url, pgid):
        work = tmp_path / "work"
        work.mkdir()
        args = ["logger=mlflow", f"logger.mlflow.tracking_uri={url}", probe("SignalServiceAt")]
        env = cli_env(**TINY, SERVICE_PGID=str(pgid), SERVICE_SIGNAL="SIGSTOP", AT_EPOCH="1")
        started = time.monotonic()
        proc = run_python([sys.executable, str(REPO / "train.py"), *args], work, env, timeout=150)
        took = time.monotonic() - started
        lines = said(proc)
        assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("warning: logger.mlflow: ") and "the run goes on without MLflow" in lines[0]
        assert "failed with exception ReadTimeoutError: Read timed out. (read timeout=8))" in lines[0], lines[0]
        assert took < 90, took  # the run (about 20 s) and one request's bound (26.5 s)
        (run,) = run_dirs(work / "logs")
        assert (run / "checkpoints" / "last.ckpt").is_file() and list(run.glob("checkpoints/epoch_*.ckpt"))
        assert "val/acc" in json.loads((run / "fit_metrics.json").read_text())
        assert (run / "test_metrics.json").is_file()

        os.killpg(pgid, signal.SIGCONT)  # answering again, for the second run to start
        second = tmp_path / "second"
        second.mkdir()
        marker = tmp_path / "stopped"
        env = {**env, "MARKER": str(marker)}
        python = str(WARM.python_on_path() / "python")  # warm; signals reach the run
        command = [python, str(REPO / "train.py"), *args, "trainer.max_epochs=1000"]
        running = subprocess.Popen(command, cwd=second, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert running.poll() is None and time.monotonic() < deadline, running.communicate()[1].decode()[-3000:]
            time.sleep(0.05)
        time.sleep(1)  # a few steps logged to the stopped server
        running.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _, stderr = running.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            running.kill()
            raise
        took = time.monotonic() - sent
        stopped = [line for line in stderr.decode().splitlines() if line.strip()]
        assert running.returncode == 128 + signal.SIGTERM, stopped
        assert len(stopped) == 1 and stopped[0].startswith("stopped by SIGTERM at epoch "), stopped
        assert "continue with: python train.py" in stopped[0]
        assert took < 15, took  # a save and STOP_WAIT_S, not a request's bound
        (run,) = run_dirs(second / "logs")
        assert (run / "checkpoints" / "last.ckpt").is_file()
        assert json.loads((run / "fit_metrics.json").read_text())["status"] == "interrupted"


# ---------------------------------------------------------------- locks


def test_a_lock_file_is_gone_once_let_go_and_a_waiter_takes_the_lock_that_follows(tmp_path):
    """tracking.locked removes its file before letting go: no lock file is left beside a store or in a sweep dir, and
    a process that opened the old file while waiting sees it is gone and takes the new one (no two holders)."""
    from engine.loggers.tracking import locked

    path = tmp_path / "store.lock"
    holders: list[str] = []
    release = threading.Event()

    def hold(name: str) -> None:
        with locked(path):
            holders.append(f"{name} in")
            if name == "first":
                release.wait(10)
            holders.append(f"{name} out")

    first = threading.Thread(target=hold, args=("first",))
    first.start()
    while not holders:
        time.sleep(0.01)
    second = threading.Thread(target=hold, args=("second",))
    second.start()
    time.sleep(0.2)  # the second waits on the file the first holds
    release.set()
    first.join(10)
    second.join(10)
    assert holders == ["first in", "first out", "second in", "second out"]
    assert not path.exists()
