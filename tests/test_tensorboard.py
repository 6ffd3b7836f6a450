"""TensorBoard as a person opens it: the real server, asked through its HTTP API about runs the test made; and what
the template's logger writes for it (events, checksums). The figures and the graph: test_tensorboard_figures.py."""

import json
import pickle
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, cli_env, run_dirs, run_python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """`python train.py model=mlp`, a sweep `-m model=mlp seed=1,2`, and the table regression (under task_name=table)
    in a fresh directory, at the test profile's size."""
    work = tmp_path_factory.mktemp("work")
    for args in (["model=mlp"], ["-m", "model=mlp", "seed=1,2"], ["experiment=diabetes", "task_name=table"]):
        proc = run_python([sys.executable, str(REPO / "train.py"), *args], work, cli_env(PROJECT_PROFILE="tiny"))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "logs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(logs):
    """`tensorboard --logdir logs`, as the README starts it, on a free loopback port."""
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen(
        [str(tensorboard), "--logdir", str(logs), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(urllib.request.urlopen(f"{url}/data/runs", timeout=5).read()):
                break
        except OSError:
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=30).read())


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def single_run(logs: Path) -> tuple[Path, str]:
    (run,) = run_dirs(logs)
    return run, f"train/runs/{run.name}/tensorboard"


def test_the_server_shows_the_runs_by_name_with_their_scalars(server, logs):
    run, name = single_run(logs)
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    # named by what tells them apart: model=mlp, alike in both, is left out (a blind new-user try found it noise)
    jobs = [f"train/multiruns/{sweep.name}/{n}/tensorboard/seed={n + 1}" for n in (0, 1)]
    (table,) = run_dirs(logs, task="table")
    table_run = f"table/runs/{table.name}/tensorboard"
    assert sorted(get(f"{server}/data/runs")) == sorted([name, *jobs, table_run])  # a sweep job's name: its change
    tags = set(get(f"{server}/data/plugin/scalars/tags")[name])
    assert {"train/loss_step", "train/acc", "val/acc", "val/acc_best", "test/acc", "test/loss", "lr-Adam"} <= tags
    assert "hp_metric" not in tags


def test_images_show_the_samples_and_the_confusion_matrix_and_the_graph_is_there(server, logs):
    _, name = single_run(logs)
    tags = ("val/samples", "val/confusion_matrix", "test/samples", "test/confusion_matrix")  # the fit's and its test's
    assert set(tags) <= set(get(f"{server}/data/plugin/images/tags")[name])
    run = urllib.parse.quote(name)
    for tag in tags:
        (*_, last) = get(f"{server}/data/plugin/images/images?run={run}&tag={urllib.parse.quote(tag)}")
        png = urllib.request.urlopen(f"{server}/data/plugin/images/individualImage?{last['query']}", timeout=30).read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert get(f"{server}/data/plugin/graphs/info")[name]["run_graph"] is True


def test_hparams_shows_what_people_vary_with_the_real_final_metrics(server, logs):
    run, _ = single_run(logs)
    experiment = post(f"{server}/data/plugin/hparams/experiment", {"experimentName": ""})
    names = {h["name"] for h in experiment["hparamInfos"]}
    assert {"model", "data", "trainer", "model.optimizer.lr", "data.batch_size", "seed"} <= names
    assert not {n for n in names if n.startswith(("paths.", "callbacks.", "hydra"))}
    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
    request = {"experimentName": "", "allowedStatuses": statuses, "colParams": [], "startIndex": 0, "sliceSize": 10}
    groups = post(f"{server}/data/plugin/hparams/session_groups", request)["sessionGroups"]
    assert sorted(g["hparams"].get("seed") for g in groups) == [1, 2, 12345, 12345]  # the sweep's jobs, the table
    (group,) = [g for g in groups if g["name"] == f"train/runs/{run.name}/tensorboard"]
    assert group["hparams"]["model"] == "mlp"
    shown = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
    final = {
        **json.loads((run / "fit_metrics.json").read_text()),
        **json.loads((run / "test_metrics.json").read_text()),
    }
    for metric in ("val/acc_best", "test/acc", "test/loss"):
        assert shown[metric] == pytest.approx(final[metric])  # the run's value, never a -1 placeholder
    # the regression's own metrics, not a classifier's list: every run's scalars are metrics
    (table,) = run_dirs(logs, task="table")
    (group,) = [g for g in groups if g["name"] == f"table/runs/{table.name}/tensorboard"]
    shown = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
    assert group["hparams"]["model"] == "regressor" and "model.optimizer.lr" in group["hparams"]
    assert shown["test/mse"] == pytest.approx(json.loads((table / "test_metrics.json").read_text())["test/mse"])


def test_screenshots_need_chromium_and_say_so(logs, tmp_path):
    env = cli_env(PATH=str(tmp_path))  # no chromium on this PATH
    proc = run_python([sys.executable, "-m", "engine.loggers.screenshots", str(logs)], tmp_path, env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no Chromium found: install Debian's chromium")


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium (make tensorboard-shots)")
def test_screenshots_of_the_scalars_hparams_and_images_pages(logs):
    run, _ = single_run(logs)
    proc = subprocess.run(
        [sys.executable, "-m", "engine.loggers.screenshots", str(logs), str(run)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for page in ("scalars", "hparams", "images"):
        png = (run / f"tensorboard_{page}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_a_run_killed_after_a_checkpoint_keeps_its_scalars_up_to_that_checkpoint(cli, tmp_path):
    """Events reach the file every `flush_secs` and after every checkpoint (engine.loggers.tensorboard), not
    after every log call: a kill -9 loses at most what came after the last checkpoint, which a resume redoes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    killed = cli(
        "train.py",
        "model=mlp",
        "trainer.max_epochs=3",
        "+trainer.limit_train_batches=8",
        "+trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=2",
        "test=false",
        "+callbacks.probe._target_=probes.KillAt",
        env={"KILL_AT_STEP": "13"},  # mid epoch 1, after epoch 0's checkpoints
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(tmp_path / "logs")
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    # epoch 0's validation (Lightning puts it at the epoch's last step, 7) and the steps logged before it
    assert [e.step for e in scalars.Scalars("val/acc")] == [7]
    assert [e.step for e in scalars.Scalars("train/acc")] == [7]  # logged after the checkpoint: a resume would not
    assert [e.step for e in scalars.Scalars("train/loss_step")][:4] == [1, 3, 5, 7], scalars.Scalars("train/loss_step")
    assert (run / "tensorboard" / "hparams.yaml").is_file()


def test_a_run_stopped_by_a_signal_before_any_checkpoint_keeps_the_scalars_it_logged(cli, tmp_path):
    """The logger holds its events until a checkpoint, `flush_secs` or the end: a stop before the first checkpoint
    still writes them (Lightning finalizes the loggers when a fit fails)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stopped = cli(
        "train.py",
        "model=mlp",
        "+trainer.limit_train_batches=8",
        "trainer.log_every_n_steps=1",
        "callbacks.run_checks.every_n_steps=1",
        "test=false",
        "+callbacks.probe._target_=probes.KillAt",
        env={"KILL_AT_STEP": "5", "KILL_SIGNAL": "SIGTERM"},  # mid epoch 0: nothing saved before the stop's own
        check=False,
    )
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (run,) = run_dirs(tmp_path / "logs")
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    # the signal came as step 5 began; that step trained, then the run stopped: its loss is there too, as last.ckpt
    # has its weights (a resume goes on at step 6)
    assert [e.step for e in scalars.Scalars("train/loss_step")] == [0, 1, 2, 3, 4, 5]
    import torch

    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 6


def test_event_checksums_are_tensorboards_own_and_its_reader_accepts_a_runs_records(logs):
    """The C checksum (engine.loggers.tensorboard) gives TensorBoard's values; its reader checks every record of a
    run written with it (a wrong checksum is a DataLossError there)."""
    import os

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    from engine.loggers.tensorboard import masked_crc32c

    for size in (0, 1, 7, 64, 4097, 60_000):
        data = os.urandom(size)
        assert masked_crc32c(data) == tensorboards(data), size
    files = list(logs.rglob("events.out.tfevents.*"))
    assert files
    tags = set()
    for path in files:
        for event in EventFileLoader(str(path)).Load():  # checks each record's two checksums
            tags.update(value.tag for value in event.summary.value)
    assert {"val/samples", "val/confusion_matrix", "val/acc"} <= tags, tags


def test_a_logger_rebuilt_from_a_pickle_uses_the_fast_checksums_too(tmp_path, monkeypatch):
    """ddp_spawn's processes get the logger as a pickle, without running __init__."""
    import pickle

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards
    from tensorboard.summary.writer import record_writer

    from engine.loggers.tensorboard import TensorBoardLogger, masked_crc32c

    pickled = pickle.dumps(TensorBoardLogger(str(tmp_path)))
    monkeypatch.setattr(record_writer, "masked_crc32c", tensorboards)  # a fresh process
    logger = pickle.loads(pickled)
    assert record_writer.masked_crc32c is masked_crc32c and logger.save_dir == str(tmp_path)


def test_a_log_call_is_one_event_and_tensorboard_reads_what_lightnings_logger_writes(tmp_path):
    """Lightning's TensorBoard logger writes an event per scalar (a summary, an event, its serialization and a record
    each: benchmarks/per_call.py); the template's writes one event a call holding every scalar of it.
    TensorBoard reads the same tags (prefixed), steps and values from both; a dict stays a run of its own per key,
    and a value that is not a number is the same error, after which the template has written nothing of that call
    (Lightning, the scalars before it)."""
    import numpy as np
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger as LightningsLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from engine.loggers.tensorboard import TensorBoardLogger

    calls = [
        ({"val/loss": torch.tensor(0.25), "val/acc": 0.5, "epoch": 3, "count": np.float32(2.0)}, 7),
        ({"lr": {"a": 0.1, "b": 0.2}, "val/loss": 0.125}, 8),
        ({"train/loss_step": torch.tensor([1.5])}, None),
    ]
    read, events = {}, {}
    for name, logger in {
        "lightning": LightningsLogger(str(tmp_path), "lightning", version="", prefix="fit", default_hp_metric=False),
        "template": TensorBoardLogger(str(tmp_path), "template", version="", prefix="fit"),
    }.items():
        for metrics, step in calls:
            logger.log_metrics(metrics, step)
        with pytest.raises(ValueError, match="you tried to log text which is currently not supported"):
            logger.log_metrics({"sound": 1.0, "note": "text"}, 9)
        logger.finalize("success")
        run = Path(logger.log_dir)
        runs = {".": run, **{p.name: p for p in sorted(run.iterdir()) if p.is_dir()}}
        read[name] = {}
        for key, folder in runs.items():
            scalars = EventAccumulator(str(folder)).Reload()
            for tag in scalars.Tags()["scalars"]:
                read[name][f"{key}:{tag}"] = [(e.step, pytest.approx(e.value)) for e in scalars.Scalars(tag)]
        (events_file,) = run.glob("events.out.tfevents.*")
        events[name] = [len(e.summary.value) for e in EventFileLoader(str(events_file)).Load() if e.summary.value]
    assert read["lightning"].pop(".:fit-sound") == [(9, 1.0)]  # written before the error; the template's is not
    assert read["template"] == read["lightning"]
    assert read["template"][".:fit-val/loss"] == [(7, 0.25), (8, 0.125)]
    assert read["template"]["fit-lr_a:fit-lr"] == [(8, 0.1)] and read["template"]["fit-lr_b:fit-lr"] == [(8, 0.2)]
    assert events == {"lightning": [1, 1, 1, 1, 1, 1, 1], "template": [4, 1, 1]}


def test_logged_scalars_reach_the_writer_thread_in_batches_at_checkpoints_every_flush_secs_and_at_the_end(
    tmp_path, monkeypatch
):
    """Each event handed to TensorBoard's writer thread wakes it, and on a small net's steps that cost about 2 ms
    an epoch (benchmarks/step_loop.py); the logger holds a call's event and hands them over in one go: after each
    checkpoint, at the first call `flush_secs` after the oldest one held, and at the end. Steps and wall times are
    the logged ones. In a ddp_spawn worker (a logger rebuilt from a pickle, which Lightning does not finalize when
    its fit fails) each call is handed over as it comes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer.event_file_writer import _AsyncWriter

    from engine.loggers import tensorboard

    handed: list[bytes] = []
    write = _AsyncWriter.write
    monkeypatch.setattr(_AsyncWriter, "write", lambda self, data: (handed.append(data), write(self, data))[1])
    clock = [1000.0]  # monotonic seconds; wall time: a day later, in the same steps
    fake = SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0] + 86_400)
    monkeypatch.setattr(tensorboard, "time", fake, raising=False)
    logger = tensorboard.TensorBoardLogger(str(tmp_path), version="", flush_secs=30)
    logger.experiment  # the file's first event (its version) is written when the writer is made
    opened = len(handed)

    def scalars(run: str) -> list[tuple[int, str, float, float]]:
        read = EventAccumulator(run).Reload()
        found = [
            (e.step, tag, round(e.value, 3), e.wall_time) for tag in read.Tags()["scalars"] for e in read.Scalars(tag)
        ]
        return sorted(found, key=lambda s: s[0])

    for step in range(3):
        logger.log_metrics({"train/loss_step": 1.0 + step}, step)
        clock[0] += 10
    assert len(handed) == opened  # 20 s after the oldest: still held
    logger.after_save_checkpoint(None)
    assert len(handed) == opened + 3
    logged = [(step, "train/loss_step", 1.0 + step, 87_400.0 + 10 * step) for step in range(3)]
    assert scalars(logger.log_dir) == logged  # the steps and wall times of the calls

    logger.log_metrics({"val/acc": 0.5}, 3)
    clock[0] += 29
    logger.log_metrics({"val/acc": 0.6}, 4)
    assert len(handed) == opened + 3
    clock[0] += 1  # 30 s after the oldest held
    logger.log_metrics({"val/acc": 0.7}, 5)
    assert len(handed) == opened + 6

    logger.log_metrics({"val/acc": 0.8}, 6)
    spawned = pickle.loads(pickle.dumps(logger))  # ddp_spawn's copy: none of the held events travel with it
    spawned.log_metrics({"val/acc": 0.9}, 7)  # and it writes each call at once: a file of its own, then the call
    assert len(handed) == opened + 6 + 2
    spawned.finalize("success")
    logger.finalize("success")
    assert [s[:3] for s in scalars(logger.log_dir)][3:] == [
        (s, "val/acc", a) for s, a in ((3, 0.5), (4, 0.6), (5, 0.7), (6, 0.8), (7, 0.9))
    ]

    assert len(handed) == opened + 9  # 0.8, held until the end


def test_a_failed_runs_logger_closes_without_replacing_the_runs_error_with_a_write_error(tmp_path):
    """The held events are written when Lightning finalizes the logger. When the writer's thread failed on the disk
    the run's error came from, it raises that error again at every write and flush: a failed run keeps its own
    error and its event files are closed all the same (a test after the fit opens new ones); a run that succeeded
    reports the write's error."""
    import errno

    from engine.loggers.tensorboard import TensorBoardLogger

    for status in ("failed", "success"):
        logger = TensorBoardLogger(str(tmp_path), version=status)
        logger.log_metrics({"val/acc": 0.5}, 0)
        logger.experiment._get_file_writer().event_writer._async_writer._worker.exception = OSError(
            errno.ENOSPC, "No space left on device"
        )  # as the writer's thread keeps the error it failed on
        if status == "failed":
            logger.finalize(status)
            assert logger.experiment.file_writer is None and logger.experiment.all_writers is None
            logger.log_metrics({"test/acc": 0.5}, 1)  # the test after a fit: a new event file
            logger.finalize("success")
            assert len(list(Path(logger.log_dir).glob("events.out.tfevents.*"))) == 2
        else:
            with pytest.raises(OSError, match="No space left"):
                logger.finalize(status)
