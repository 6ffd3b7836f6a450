"""TensorBoard as a person opens it: the real server, asked through its HTTP API about runs the test made."""

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_dirs, run_python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """`python train.py model=mlp` and a sweep `-m model=mlp seed=1,2` in a fresh directory, at the test
    profile's size."""
    work = tmp_path_factory.mktemp("work")
    for args in (["model=mlp"], ["-m", "model=mlp", "seed=1,2"]):
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
    jobs = [f"train/multiruns/{sweep.name}/{n}/tensorboard/model=mlp,seed={n + 1}" for n in (0, 1)]
    assert sorted(get(f"{server}/data/runs")) == sorted([name, *jobs])  # a sweep job's name says what it changed
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
    assert sorted(g["hparams"].get("seed") for g in groups) == [1, 2, 12345]  # the sweep's jobs beside the run
    (group,) = [g for g in groups if g["name"] == f"train/runs/{run.name}/tensorboard"]
    assert group["hparams"]["model"] == "mlp"
    shown = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
    final = {
        **json.loads((run / "fit_metrics.json").read_text()),
        **json.loads((run / "test_metrics.json").read_text()),
    }
    for metric in ("val/acc_best", "test/acc", "test/loss"):
        assert shown[metric] == pytest.approx(final[metric])  # the run's value, never a -1 placeholder


def test_screenshots_need_chromium_and_say_so(logs, tmp_path):
    env = cli_env(PATH=str(tmp_path))  # no chromium on this PATH
    proc = run_python([sys.executable, "-m", "project.loggers.screenshots", str(logs)], tmp_path, env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no Chromium found: install Debian's chromium")


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium (make tensorboard-shots)")
def test_screenshots_of_the_scalars_hparams_and_images_pages(logs):
    run, _ = single_run(logs)
    proc = subprocess.run(
        [sys.executable, "-m", "project.loggers.screenshots", str(logs), str(run)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for page in ("scalars", "hparams", "images"):
        png = (run / f"tensorboard_{page}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_figures_are_drawn_with_no_torch_op_in_their_thread(make_cfg, monkeypatch):
    """A torch op in a second thread starts a second OpenMP thread team; with more OpenMP threads than cores,
    libgomp stops spinning, and every later training step of the process ran up to 3x slower on 2 cores. The
    drawing thread gets numpy arrays only; a torch function mode in that thread records any torch call."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.overrides import TorchFunctionMode

    import project.callbacks.tensorboard as insights
    from project.tasks.training import train

    calls: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def painter(workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix, initializer=Record().__enter__)

    monkeypatch.setattr(insights, "ThreadPoolExecutor", painter)
    cfg = make_cfg("profile=tiny", "model=mlp", "test=false", "trainer.max_epochs=1")
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    drawn = EventAccumulator(str(events)).Reload().Tags()["images"]
    assert {"val/samples", "val/confusion_matrix"} <= set(drawn)
    assert calls == []


def test_an_image_summary_is_the_array_as_a_lossless_png():
    """The figures are written pre-encoded (PNG at the fast level, no resize): the pixels TensorBoard shows are
    exactly the ones drawn."""
    import io

    import numpy as np
    from PIL import Image

    from project.loggers import figures

    drawn = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    (value,) = figures.image_summary("val/samples", drawn).value
    assert (value.tag, value.image.height, value.image.width, value.image.colorspace) == ("val/samples", 40, 60, 3)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string))), drawn)


def test_a_run_killed_after_a_checkpoint_keeps_its_scalars_up_to_that_checkpoint(cli, tmp_path):
    """Events reach the file every `flush_secs` and after every checkpoint (project.loggers.tensorboard), not
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
    assert [e.step for e in scalars.Scalars("train/loss_step")][:4] == [1, 3, 5, 7], scalars.Scalars("train/loss_step")
    assert (run / "tensorboard" / "hparams.yaml").is_file()


def test_event_checksums_are_tensorboards_own_and_its_reader_accepts_a_runs_records(logs):
    """The C checksum (project.loggers.tensorboard) gives TensorBoard's values; its reader checks every record of a
    run written with it (a wrong checksum is a DataLossError there)."""
    import os

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    from project.loggers.tensorboard import masked_crc32c

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

    from project.loggers.tensorboard import TensorBoardLogger, masked_crc32c

    pickled = pickle.dumps(TensorBoardLogger(str(tmp_path)))
    monkeypatch.setattr(record_writer, "masked_crc32c", tensorboards)  # a fresh process
    logger = pickle.loads(pickled)
    assert record_writer.masked_crc32c is masked_crc32c and logger.save_dir == str(tmp_path)


@pytest.mark.parametrize("interval", [3600, 0])
def test_figures_come_at_most_every_min_interval_and_always_for_the_last_epoch(make_cfg, interval):
    """TensorBoard shows 10 images of a tag (it samples the rest), and drawing them cost a 0.2 s epoch about 18 ms
    (benchmarks/step_loop.py): figures come once `min_interval_s` (10 s) has passed since the fit started or since
    the figures before, and the last epoch's always (a short fit gets only those); `min_interval_s=0` draws every
    epoch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks.training import train

    interval_s = f"callbacks.tensorboard.min_interval_s={interval}"
    cfg = make_cfg("profile=tiny", "model=mlp", "test=false", "trainer.max_epochs=3", interval_s)
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    run = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    epochs = [e.step for e in run.Scalars("val/acc")]
    assert len(epochs) == 3
    for tag in ("val/samples", "val/confusion_matrix"):
        drawn = [e.step for e in run.Images(tag)]
        assert drawn == (epochs if interval == 0 else [epochs[-1]]), tag


def test_a_fit_stopped_by_a_signal_still_gets_its_last_figures(cli, tmp_path):
    """A fit shorter than min_interval_s holds its figures back for its end; one that a signal stops (or an error
    ends) skips Lightning's on_train_end, and drew none. The held-back figures are drawn as it stops."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stopped = cli(
        "train.py", "model=mlp", "trainer.max_epochs=2", "+callbacks.probe._target_=probes.SignalAt",
        env={"PROJECT_PROFILE": "tiny", "SIGNAL_AT": "last_validation"}, check=False,
    )  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (run,) = run_dirs(tmp_path / "logs")
    (events,) = run.glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    last = found.Scalars("val/acc")[-1].step
    for tag in ("val/samples", "val/confusion_matrix"):
        assert [e.step for e in found.Images(tag)] == [last], tag


def test_an_evaluation_draws_the_test_sets_figures_for_a_users_net(make_cfg, tmp_path):
    """eval.py, like the test after a fit, draws the test set's sample grid and confusion matrix (from what the
    classifier's test_step returns) at the step of its test scalars; here with a net written as users write them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks.evaluation import evaluate
    from project.tasks.training import train

    user_net = ("~model.net", "+model.net._target_=user_models.TutorialCNN")
    train(make_cfg("profile=tiny", *user_net, "logger=none", "test=false"))
    (best,) = (tmp_path / "out" / "checkpoints").glob("epoch_*.ckpt")
    out = tmp_path / "evaluated"
    ckpt = (f"ckpt_path={best}", "trusted_packages=[user_models]")
    evaluate(make_cfg("profile=tiny", *ckpt, f"paths.output_dir={out}", name="eval"))
    (events,) = out.glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0}).Reload()
    (tested,) = [e.step for e in found.Scalars("test/acc")]
    assert {tag: [e.step for e in found.Images(tag)] for tag in found.Tags()["images"]} == {
        "test/samples": [tested],
        "test/confusion_matrix": [tested],
    }


def test_a_confusion_matrix_sized_by_the_labels_grows_with_them(tmp_path):
    """A module without `num_classes` gets a matrix as large as the largest label seen: a later batch with a larger
    label than the first ones failed the test (tensors of 8 and 10 classes added); a module that returns nothing
    gets no figure."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from project.callbacks.tensorboard import TensorBoardInsights

    class Labels(L.LightningModule):  # no num_classes; predicts the label it is given
        def __init__(self, returns: bool) -> None:
            super().__init__()
            self.returns, self.layer = returns, nn.Linear(1, 1)

        def test_step(self, batch, batch_idx):
            x, y = batch
            return {"preds": y, "target": y} if self.returns else None

    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # batches of 4: largest 3, then 7, then 9
    data = DataLoader(TensorDataset(torch.zeros(10, 1, 1, 1), labels), batch_size=4)
    for returns in (True, False):
        logger = TensorBoardLogger(str(tmp_path), name=str(returns), version="")
        trainer = L.Trainer(
            accelerator="cpu", logger=logger, callbacks=[TensorBoardInsights(images=False)], enable_progress_bar=False
        )
        trainer.test(Labels(returns), data)
        (events,) = (tmp_path / str(returns)).glob("events.out.tfevents.*")
        images = EventAccumulator(str(events), size_guidance={"images": 0}).Reload().Tags()["images"]
        assert images == (["test/confusion_matrix"] if returns else [])


def test_the_graph_is_traced_once_without_torchs_trace_check(make_cfg, monkeypatch):
    """SummaryWriter.add_graph traces with torch.jit.trace's check_trace: two more traces, compared, about twice
    the time of tracing once at every run's first step (benchmarks/graph.py). The graph is only drawn, so it is
    traced once; TensorBoard still gets it, for a user's net too."""
    import torch.jit._trace as tracing
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from project.tasks.training import train

    checks: list[str] = []
    check = tracing._check_trace
    monkeypatch.setattr(tracing, "_check_trace", lambda *a, **k: (checks.append("check"), check(*a, **k))[1])
    user_net = ("~model.net", "+model.net._target_=user_models.TutorialCNN")
    cfg = make_cfg("profile=tiny", *user_net, "test=false", "trainer.max_epochs=1")
    train(cfg)
    (events,) = Path(cfg.paths.output_dir).glob("tensorboard/events.out.tfevents.*")
    found = EventAccumulator(str(events)).Reload()
    assert found.Tags()["graph"] and any(node.op == "aten::_convolution" for node in found.Graph().node)
    assert checks == []


def test_drawing_the_graph_leaves_each_submodules_mode_as_it_was():
    """The graph is traced in eval mode; afterwards every submodule is back in its own mode: a part the user keeps
    in eval (a frozen BatchNorm backbone) stayed in train mode after the graph before, and BatchNorm's batch count
    is not moved by the trace."""
    import torch
    from torch import nn

    from project.callbacks.tensorboard import _graph

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(1352, 10))
    net[1].eval()  # frozen by the user
    _graph(net, torch.zeros(2, 1, 28, 28))
    assert [m.training for m in net.modules()] == [True, True, False, True, True, True]
    assert int(net[2].num_batches_tracked) == 0  # traced in eval mode


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

    from project.loggers.tensorboard import TensorBoardLogger

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
