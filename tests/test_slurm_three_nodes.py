"""An odd count of nodes: slurm/train.sbatch across 3 SLURM nodes of this host (tests/slurm_cluster.py), a cluster of
its own for this module. Each node's rank trains its own third of every epoch, into one run dir."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, WARM, cli_env, run_dirs
from slurm_cluster import Cluster, slurm_nodes  # noqa: F401  the fixture
from test_slurm_nodes import LAUNCHER_VARS, RUN, STEPS_PER_EPOCH

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("slurm_nodes", [3], indirect=True)
def test_ddp_across_three_nodes(slurm_nodes: Cluster, tmp_path: Path):  # noqa: F811
    (tmp_path / "probe").mkdir()
    env = cli_env(PROJECT_PROFILE="tiny", PROBE_DIR=str(tmp_path / "probe"))
    env["PATH"] = os.pathsep.join([str(WARM.python_on_path()), str(Path(sys.executable).parent), env["PATH"]])
    env = {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARS)}
    options = ["--nodes=3", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1", f"--output={tmp_path}/job.out"]
    job_id = slurm_nodes.sbatch(*options, "slurm/train.sbatch", *RUN, f"paths.root_dir={tmp_path}", cwd=REPO, env=env)
    info = slurm_nodes.wait(job_id, timeout=180)
    output = (tmp_path / "job.out").read_text(errors="replace") if (tmp_path / "job.out").is_file() else ""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{output[-3000:]}"
    assert info["NodeList"] == "127.0.0.[1-3]"
    (run,) = run_dirs(tmp_path / "logs")
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["trainer"]
    assert (config["num_nodes"], config["devices"]) == (3, 1)  # from $SLURM_NNODES
    seen = [json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(r["rank"], r["node_rank"], r["world_size"]) for r in seen] == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    shards = [set(r["seen"]["0"]) for r in seen]
    assert not (shards[0] & shards[1] or shards[0] & shards[2] or shards[1] & shards[2])  # each its own third
    assert sorted(p.name for p in run.glob("*.log")) == [
        "train.log",
        "train_ddp_process_1.log",
        "train_ddp_process_2.log",
    ]
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 2 * STEPS_PER_EPOCH
