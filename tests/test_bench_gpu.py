"""benchmarks/gpu_models.py (`make bench-gpu`) at its tiny shapes: every loop (hand-written, bare Lightning, this
template's `python train.py`), both data paths, both models, to the JSON and the figure. On CPU here; on a CUDA GPU the
same tiny run also has peak memory and, on a device in Lightning's table, MFU."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

LOOPS = {
    ("hand-written", "on device"),
    ("hand-written", "DataLoader"),
    ("bare Lightning", "on device"),
    ("bare Lightning", "DataLoader"),
    ("this template", "template's loader, on device"),
}


def test_the_gpu_benchmark_runs_every_loop_at_tiny_shapes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_models.py"), "--tiny", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (path,) = tmp_path.glob("gpu_models_*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    results = json.loads(path.read_text())
    assert results["device"].strip() and results["tiny"] is True
    cuda = results["accelerator"] == "cuda"
    if not cuda:
        assert path.name == "gpu_models_cpu.json"
    rows = results["rows"]
    assert {(row["model"], row["compile"], row["loop"], row["data"]) for row in rows} == {
        (model, "off", loop, data) for model in ("resnet50", "gpt2") for loop, data in LOOPS
    }
    for row in rows:
        assert row["samples_per_s"] > 0 and row["min"] > 0 and row["step_ms"] > 0, row
        assert row["flops_per_sample"] > 0, row
        assert (row["tokens_per_s"] is not None) == (row["model"] == "gpt2"), row
        if cuda:
            assert row["peak_memory_gib"] > 0, row
            assert row["mfu"] is None if results["peak_flops"] is None else 0 < row["mfu"] < 1, row
        else:
            assert row["mfu"] is None and row["peak_memory_gib"] is None, row
        assert row["label"] in proc.stdout  # each row printed as it is measured
