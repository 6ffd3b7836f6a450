"""Two "nodes" on this machine without SLURM, started with the commands docs/several-nodes-and-slurm.md gives:
torchrun's c10d rendezvous (`--nnodes=2`, one agent per node) and Lightning's own MASTER_ADDR / NODE_RANK way; a
node's worker killed under `--max-restarts=1` (the run finishes with the unbroken run's weights, bit for bit); the
line that says how to continue a stopped torchrun run, added to its command.

The commands are read from the page and only their sizes changed (1 process per node, CPU, a tiny run), so a
change to the page that these tests do not follow fails here. Every process runs warm (tests/warm.py)."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS, WARM, run_dirs

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "several-nodes-and-slurm.md"
TORCHRUN = Path(sys.executable).with_name("torchrun")  # the console script `torchrun` of this venv
TIMEOUT_S = 240

# 3 epochs of 5 training batches (debug=limit); dropout and shuffling on, so a resume that lost any state shows
TINY = [
    "trainer.accelerator=cpu",
    "model=mlp",
    "debug=limit",
    "seed=1",
    "trainer.deterministic=true",
    "logger=none",
    "callbacks.last_checkpoint.every_n_steps=2",
    "+callbacks.probe._target_=probes.ShardProbe",
    "+callbacks.kill._target_=probes.KillAt",  # writes each rank's pid; $STEP_SLEEP slows the steps
]


def documented(start: str, sizes: dict[str, str]) -> list[str]:
    """The page's command that begins with `start` (continuation lines joined, comment dropped), split as the shell
    splits it, with each of `sizes`' words replaced: every one must be in the command."""
    text = PAGE.read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.strip().startswith(start)]
    argv = shlex.split(line.split(" #", 1)[0])
    missing = [word for word in sizes if word not in argv]
    assert not missing, f"{PAGE.name} no longer says {missing}: {line.strip()}"
    return [sizes.get(word, word) for word in argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(run_id: str, port: int, *extra: str) -> list[str]:
    """The page's two-node torchrun command for one node of this machine: `extra` goes before train.py (torchrun's
    own flags)."""
    argv = documented(
        "torchrun --nnodes=2",
        {
            "--nproc_per_node=4": "--nproc_per_node=1",
            "--rdzv-endpoint=HOST:29500": f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=exp1": f"--rdzv-id={run_id}",
            "train.py": str(REPO / "train.py"),
            "trainer.devices=4": "trainer.devices=1",
        },
    )
    script = argv.index(str(REPO / "train.py"))
    python = str(WARM.python_on_path() / "python")  # the agents warm; their workers are forked warm too
    return [python, str(TORCHRUN), *argv[1:script], *extra, *argv[script:]]


def environment(**extra: str) -> dict[str, str]:
    """This test process's environment less any launcher's variables, tests/ importable (the probes)."""
    launcher = ("SLURM_", "TORCHELASTIC", "MASTER_", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return {**env, "PYTHONPATH": str(TESTS), **extra}


class Nodes:
    """Two node commands started side by side in `cwd`, each in its own process group."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], cwd: Path, probe: Path) -> None:
        self.probe, self.started = probe, time.monotonic()
        self.procs = [
            subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for argv, env in commands
        ]

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.kill_all()
                outs = [p.communicate()[0][-3000:] for p in self.procs]
                pytest.fail(f"never saw {what}:\n" + "\n---\n".join(outs))
            time.sleep(0.05)

    def finish(self) -> tuple[list[int], list[str]]:
        try:
            outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in self.procs]
        finally:
            self.kill_all()
        self.wall_s = time.monotonic() - self.started
        return [p.returncode for p in self.procs], outs

    def kill_all(self) -> None:
        """Whatever is left: the node commands' groups, and the warm workers (forked elsewhere: their own pids)."""
        pids = [int(f.read_text()) for f in self.probe.glob("pid_*") if f.read_text().strip().isdigit()]
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_equal_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"weights that differ from the unbroken run's: {different}"


def start_torchrun(work: Path, run_id: str, *extra: str, **env: str) -> Nodes:
    probe = work / "probe"
    probe.mkdir(parents=True)
    port = free_port()
    node = torchrun_node(run_id, port, *extra)
    return Nodes([(node + TINY, environment(PROBE_DIR=str(probe), **env))] * 2, work, probe)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> tuple[Path, list[int], list[str], float]:
    """The page's two-node torchrun command, one agent per "node", trained to its end."""
    work = tmp_path_factory.mktemp("unbroken")
    nodes = start_torchrun(work, "unbroken")
    codes, outs = nodes.finish()
    return work, codes, outs, nodes.wall_s


def test_torchrun_two_nodes_train_one_run_in_one_directory(unbroken):
    work, codes, outs, wall_s = unbroken
    assert codes == [0, 0], "\n---\n".join(out[-3000:] for out in outs)
    (run,) = run_dirs(work / "logs")
    assert run.name == "torchrun_unbroken"
    assert (run / "checkpoints" / "last.ckpt").is_file() and list((run / "checkpoints").glob("epoch_*.ckpt"))
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 15
    assert json.loads((run / "fit_metrics.json").read_text())["status"] == "ok"
    assert (run / "test_metrics.json").is_file()
    config = (run / ".hydra" / "config.yaml").read_text()
    assert re.search(r"^  devices: 1$", config, re.M) and re.search(r"^  num_nodes: 2$", config, re.M)
    # each rank its own log (they were interleaved in train.log)
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log", "train_ddp_process_1.log"]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in (run / "train.log").read_text()
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in (run / "train_ddp_process_1.log").read_text()
    assert "GLOBAL_RANK: 1" not in (run / "train.log").read_text()
    seen = [json.loads((work / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["node_rank"], r["environment"]) for r in seen] == [
        (2, 0, "TorchElasticEnvironment"),
        (2, 1, "TorchElasticEnvironment"),
    ]
    assert not set(seen[0]["seen"]["0"]) & set(seen[1]["seen"]["0"])  # each node its own shard
    print(f"two torchrun nodes: {wall_s:.1f} s")


def by_hand(tmp_path: Path, **env: str) -> tuple[Nodes, Path]:
    """The page's two commands started by hand (MASTER_ADDR, NODE_RANK), one per "node", into one named directory."""
    probe, shared = tmp_path / "probe", tmp_path / "shared" / "runs" / "exp1"
    probe.mkdir()
    port = str(free_port())
    python = str(WARM.python_on_path() / "python")
    commands = []
    for node in (0, 1):
        argv = documented(
            "MASTER_ADDR=HOST MASTER_PORT=29500 NODE_RANK=0 python train.py",
            {
                "MASTER_ADDR=HOST": "MASTER_ADDR=127.0.0.1",
                "MASTER_PORT=29500": f"MASTER_PORT={port}",
                "NODE_RANK=0": f"NODE_RANK={node}",  # "NODE_RANK=1 on the second"
                "python": python,
                "train.py": str(REPO / "train.py"),
                "trainer.devices=4": "trainer.devices=1",
                "hydra.run.dir=/shared/runs/exp1": f"hydra.run.dir={shared}",
            },
        )
        variables = dict(word.split("=", 1) for word in argv[:3])
        commands.append((argv[3:] + TINY, environment(PROBE_DIR=str(probe), **variables, **env)))
    return Nodes(commands, tmp_path, probe), shared


def test_nodes_started_by_hand_with_node_rank_share_the_named_directory(tmp_path):
    nodes, shared = by_hand(tmp_path)
    probe = nodes.probe
    codes, outs = nodes.finish()
    assert codes == [0, 0], "\n---\n".join(out[-3000:] for out in outs)
    assert (shared / "checkpoints" / "last.ckpt").is_file() and (shared / "fit_metrics.json").is_file()
    assert re.search(r"^  num_nodes: 2$", (shared / ".hydra" / "config.yaml").read_text(), re.M)
    assert not (tmp_path / "logs").exists()  # nothing beside the named directory
    seen = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["node_rank"], r["environment"]) for r in seen] == [
        (2, 0, "LightningEnvironment"),
        (2, 1, "LightningEnvironment"),
    ]
    print(f"two nodes by hand: {nodes.wall_s:.1f} s")


def test_a_node_started_by_hand_and_stopped_exits_as_stopped_and_says_how_to_continue(tmp_path):
    """SIGTERM to the second node's command: it exited 0 and said nothing (taken for a child of Lightning's
    launcher, which ends quietly), so a script or scheduler watching that node saw a finished run."""
    nodes, shared = by_hand(tmp_path, STEP_SLEEP="0.2")
    nodes.wait_for(lambda: (shared / "checkpoints" / "last.ckpt").is_file(), "a first last.ckpt")
    os.kill(nodes.procs[1].pid, signal.SIGTERM)
    codes, outs = nodes.finish()
    assert codes == [143, 143], "\n---\n".join(out[-3000:] for out in outs)
    for out in outs:
        (line,) = [line for line in out.splitlines() if "continue with: " in line]
        assert line.startswith("stopped by SIGTERM at epoch ") and line.endswith(" added to the run's command"), line


@pytest.fixture(scope="module")
def node_killed(tmp_path_factory) -> tuple[Path, list[int], list[str]]:
    """Node 1's worker (rank 1) killed with SIGKILL once the run has saved a checkpoint, both agents with
    `--max-restarts=1`."""
    work = tmp_path_factory.mktemp("killed")
    nodes = start_torchrun(work, "killed", "--max-restarts=1", STEP_SLEEP="0.2")
    run = work / "logs" / "train" / "runs" / "torchrun_killed"
    nodes.wait_for(lambda: (run / "checkpoints" / "last.ckpt").is_file(), "a first last.ckpt")
    nodes.wait_for(lambda: (nodes.probe / "pid_1").is_file(), "rank 1's pid")
    time.sleep(0.5)  # mid-run: between the saves at steps 2 and 4 (0.2 s a step)
    os.kill(int((nodes.probe / "pid_1").read_text()), signal.SIGKILL)
    codes, outs = nodes.finish()
    print(f"a node's worker killed, restarted: {nodes.wall_s:.1f} s")
    return run, codes, outs


def test_a_killed_node_comes_back_from_the_newest_checkpoint_with_the_unbroken_weights(node_killed, unbroken):
    run, codes, outs = node_killed
    assert codes == [0, 0], "\n---\n".join(out[-3000:] for out in outs)
    assert all("Resuming from " in out for out in outs)  # both nodes' workers started again, from a checkpoint
    assert any("failed (exitcode: -9)" in out for out in outs)  # rank 1 may be on either node: c10d assigns them
    (whole,) = run_dirs(unbroken[0] / "logs")
    assert_equal_weights(weights(run), weights(whole))


def test_the_node_that_did_not_fail_is_not_refused_its_own_directory(node_killed):
    """torchrun restarts the workers of the node that did not fail with TORCHELASTIC_RESTART_COUNT=0 (a membership
    change, not a failure): they continue their launch's directory as a restart does (engine.runs.dirs.continuing)."""
    _, _, outs = node_killed
    assert "already holds checkpoints of an earlier run" not in outs[0]


def test_a_node_killed_without_restarts_leaves_a_line_that_says_how_to_continue(tmp_path):
    """Without --max-restarts, kill -9 of one node's worker ended the other node's rank with "lost the connection to
    another rank" and no way to continue in it."""
    nodes = start_torchrun(tmp_path, "lost", STEP_SLEEP="0.2")
    run = tmp_path / "logs" / "train" / "runs" / "torchrun_lost"
    nodes.wait_for(lambda: (run / "checkpoints" / "last.ckpt").is_file(), "a first last.ckpt")
    nodes.wait_for(lambda: (nodes.probe / "pid_1").is_file(), "rank 1's pid")
    os.kill(int((nodes.probe / "pid_1").read_text()), signal.SIGKILL)
    codes, outs = nodes.finish()
    assert codes[0] != 0 and codes[1] != 0
    said = [line for out in outs for line in out.splitlines() if "continue with: ckpt_path=" in line]
    assert said and all(line.endswith("added to the run's command") for line in said), "\n---\n".join(outs)
    print(f"a node killed, no restarts: {nodes.wall_s:.1f} s; {said[0]}")


def test_the_printed_command_continues_a_torchrun_run_stopped_on_one_node(tmp_path):
    """The line says `ckpt_path=<run>/checkpoints/last.ckpt added to the run's command`: the same torchrun command
    (the same --rdzv-id, so the same directory) with it continues there. It was refused: the directory holds
    checkpoints of an earlier run."""
    nodes = start_torchrun(tmp_path / "stopped", "stopped", STEP_SLEEP="0.2")
    run = tmp_path / "stopped" / "logs" / "train" / "runs" / "torchrun_stopped"
    nodes.wait_for(lambda: (run / "checkpoints" / "last.ckpt").is_file(), "a first last.ckpt")
    os.kill(nodes.procs[1].pid, signal.SIGTERM)  # node 1's agent: passed on to its worker
    codes, outs = nodes.finish()
    assert codes[0] != 0 and codes[1] != 0
    # rank 0 says it, on whichever node c10d put it
    line = next(line for out in outs for line in out.splitlines() if "continue with: " in line)
    said = line.split("continue with: ", 1)[1]
    added = said.removesuffix(" added to the run's command")
    assert added != said and added.startswith("ckpt_path="), said
    print(f"stopped: {nodes.wall_s:.1f} s; continue with: {said}")
    (tmp_path / "stopped" / "probe").rename(tmp_path / "stopped" / "probe_first")
    (tmp_path / "stopped" / "probe").mkdir()
    node = torchrun_node("stopped", free_port())
    env = environment(PROBE_DIR=str(tmp_path / "stopped" / "probe"))
    again = Nodes([(node + TINY + [added], env)] * 2, tmp_path / "stopped", tmp_path / "stopped" / "probe")
    codes, outs = again.finish()
    print(f"the printed command: {again.wall_s:.1f} s, exit {codes}")
    assert codes == [0, 0], "\n".join(line for out in outs for line in out.splitlines() if line.startswith("error:"))
