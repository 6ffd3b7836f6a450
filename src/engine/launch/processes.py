"""Checks on the processes a run asks for, before the Trainer starts any: against the external launcher
(torchrun, srun), against the machine (CPU cores), and for several nodes (where to meet). No torch imports.
"""

import os
from typing import Any

from engine.errors import UserError
from engine.launch.environment import under_slurm, under_torchrun


def _count(devices: Any) -> int | None:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if not isinstance(devices, (str, int)) and hasattr(devices, "__len__"):
        return len(devices)
    return None  # "auto", -1: Lightning decides


def check_process_count(devices: Any, num_nodes: int, strategy: Any) -> None:
    """The trainer must ask for exactly the processes the external launcher made."""
    env = os.environ
    if strategy == "dp" and num_nodes > 1:
        raise UserError(
            "trainer.strategy=dp drives the GPUs of one machine from one process: set "
            "trainer.num_nodes=1, or use trainer.strategy=ddp across nodes"
        )
    if under_torchrun():
        launcher, started = "torchrun", int(env.get("WORLD_SIZE", "1"))
        fix = "trainer.devices=<--nproc_per_node> trainer.num_nodes=<--nnodes>"
    elif under_slurm() and int(env.get("SLURM_NTASKS", "1")) > 1:
        launcher, started = "srun", int(env["SLURM_NTASKS"])
        fix = "trainer.devices=<--ntasks-per-node> trainer.num_nodes=<--nodes>"
    else:
        return
    forks = strategy.startswith(("ddp_fork", "ddp_notebook")) if isinstance(strategy, str) else False  # and _find_..
    if isinstance(strategy, str) and ("spawn" in strategy or forks or strategy == "dp"):
        raise UserError(
            f"trainer.strategy={strategy} runs its own processes, but {launcher} already started "
            f"{started}: use trainer.strategy=ddp (or fsdp)"
        )
    n = _count(devices)
    if launcher == "srun":
        if "SLURM_NTASKS_PER_NODE" not in env:  # `srun -n 2`: Lightning places ranks by tasks per node
            raise UserError(
                f"srun started {started} tasks without --ntasks-per-node, which places the ranks on the nodes: "
                f"srun --ntasks-per-node={started} (or #SBATCH --ntasks-per-node=...), one task per device"
            )
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "4(x2)" on heterogeneous allocations
        nodes = env.get("SLURM_NNODES", "")
        if n is not None and per_node.isdigit() and int(per_node) != n:
            raise UserError(
                f"srun started {per_node} tasks per node but trainer.devices={devices}: set "
                f"trainer.devices={per_node}, or #SBATCH --ntasks-per-node={n} (one task per device)"
            )
        if nodes.isdigit() and int(nodes) != num_nodes:
            raise UserError(
                f"the SLURM job has {nodes} nodes but trainer.num_nodes={num_nodes}: set "
                f"trainer.num_nodes={nodes}, or #SBATCH --nodes={num_nodes}"
            )
    elif n is not None and n * num_nodes != started:
        raise UserError(
            f"{launcher} started {started} processes, but trainer.devices={devices} x trainer.num_nodes="
            f"{num_nodes} = {n * num_nodes}: set {fix}"
        )


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpu_processes(count: int, allow_oversubscribe: bool) -> None:
    """More CPU processes than cores only compete for them (64 ranks on 2 cores: 16 GB of memory and no speed)."""
    cores = usable_cores()
    if count > cores and not allow_oversubscribe:
        raise UserError(
            f"trainer.devices={count} CPU processes on a machine with {cores} usable cores: use at most "
            f"trainer.devices={cores}, or launch.allow_oversubscribe=true to start them anyway"
        )


def check_node_meeting(num_nodes: int, environment: str) -> None:
    """Several nodes without torchrun or SLURM meet at MASTER_ADDR:MASTER_PORT, which every node must be given:
    Lightning would pick a random port on each node, and they would wait for each other forever."""
    if environment != "LightningEnvironment":
        return  # torchrun, SLURM, LSF, MPI: the launcher tells every process where to meet
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not os.environ.get(var)]
    if missing:
        raise UserError(
            f"trainer.num_nodes={num_nodes} without torchrun or srun: set {', '.join(missing)} on every node "
            f"(MASTER_ADDR=<node 0's address> MASTER_PORT=<a free port> NODE_RANK=<0..{num_nodes - 1}>), "
            "or launch with torchrun / srun"
        )
