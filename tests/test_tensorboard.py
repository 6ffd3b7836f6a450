"""TensorBoard as a person opens it: the real server, asked through its HTTP API about runs the test made."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_dirs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """`python train.py model=mlp` in a fresh directory, at the test profile's size."""
    work = tmp_path_factory.mktemp("work")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "model=mlp"],
        cwd=work,
        env=cli_env(PROJECT_PROFILE="tiny"),
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_the_server_shows_the_runs_scalars(server, logs):
    (run,) = run_dirs(logs)
    name = f"train/runs/{run.name}/tensorboard"
    assert get(f"{server}/data/runs") == [name]
    tags = set(get(f"{server}/data/plugin/scalars/tags")[name])
    assert {"train/loss_step", "train/acc", "val/acc", "val/acc_best", "test/acc", "test/loss", "lr-Adam"} <= tags
    assert "hp_metric" not in tags


def test_hparams_shows_what_people_vary_with_the_real_final_metrics(server, logs):
    (run,) = run_dirs(logs)
    experiment = post(f"{server}/data/plugin/hparams/experiment", {"experimentName": ""})
    names = {h["name"] for h in experiment["hparamInfos"]}
    assert {"model", "data", "trainer", "model.optimizer.lr", "data.batch_size", "seed"} <= names
    assert not {n for n in names if n.startswith(("paths.", "callbacks.", "hydra"))}
    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
    request = {"experimentName": "", "allowedStatuses": statuses, "colParams": [], "startIndex": 0, "sliceSize": 10}
    (group,) = post(f"{server}/data/plugin/hparams/session_groups", request)["sessionGroups"]
    assert group["hparams"]["model"] == "mlp"
    shown = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
    final = {
        **json.loads((run / "fit_metrics.json").read_text()),
        **json.loads((run / "test_metrics.json").read_text()),
    }
    for metric in ("val/acc_best", "test/acc", "test/loss"):
        assert shown[metric] == pytest.approx(final[metric])  # the run's value, never a -1 placeholder
