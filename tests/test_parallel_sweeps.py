"""Parallel sweeps (hydra/launcher=parallel): one slot per worker process, its own GPUs or CPU cores.

GPU pinning is not run on a GPU here: the GPU ids come from CUDA_VISIBLE_DEVICES, set by the tests."""

import re
import subprocess
import sys
import time

import pytest
from conftest import cli_env

from project.callbacks.device_slots import share, visible_gpus

CLAIM = "from pathlib import Path; from project.callbacks.device_slots import claim_slot; import sys, time; "


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

    refused = cli(
        "train.py", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=3", "seed=1,2,3",
        env={"CUDA_VISIBLE_DEVICES": "0,1"}, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr == "error: hydra.launcher.n_jobs=3: only 2 GPUs; run at most one job per GPU\n"
