"""Who started this process (torchrun, SLURM's srun, or us), and what that implies. No torch imports.

Processes started by an external launcher each compose their own config, so anything they must agree
on (the run dir) comes from the launcher's environment, and the trainer's devices x num_nodes must
match the processes the launcher made. Checked here, before the Trainer, with the flags that fix it.
"""

import os
from typing import Any

from project.errors import UserError


def torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def slurm() -> bool:
    """Lightning's own SLURM test: srun/sbatch set SLURM_NTASKS; interactive shells do not count."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def submitit_slurm() -> bool:
    """A job started by submitit (hydra/launcher=slurm). submitit handles preemption and requeue itself."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def shared_run_name() -> str | None:
    """A run-dir name every process of one launch computes alike, or None when we launch the ranks ourselves.

    SLURM's is stable across a requeue, so Lightning finds its hpc_ckpt_*.ckpt there and resumes.
    """
    env = os.environ
    if torchrun():
        return f"torchrun_{env['TORCHELASTIC_RUN_ID']}"
    if slurm() and "SLURM_JOB_ID" in env:
        step = env.get("SLURM_STEP_ID", "")
        return f"slurm_{env['SLURM_JOB_ID']}" + (f"_{step}" if step.isdigit() else "")
    return None


def _count(devices: Any) -> int | None:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    return None  # "auto", -1: Lightning decides


def check(devices: Any, num_nodes: int, strategy: Any) -> None:
    """The trainer must ask for exactly the processes the external launcher made."""
    env = os.environ
    n = _count(devices)
    spawns = isinstance(strategy, str) and "spawn" in strategy or strategy in ("ddp_fork", "ddp_notebook")
    if torchrun():
        if spawns:
            raise UserError(f"trainer.strategy={strategy} starts its own processes, but torchrun already started them: "
                            "use trainer.strategy=ddp (or fsdp)")
        world = int(env.get("WORLD_SIZE", "1"))
        if n is not None and n * num_nodes != world:
            raise UserError(f"torchrun started {world} processes, but trainer.devices={devices} x trainer.num_nodes="
                            f"{num_nodes} = {n * num_nodes}: set trainer.devices=<--nproc_per_node> "
                            "trainer.num_nodes=<--nnodes>")
    elif slurm() and int(env.get("SLURM_NTASKS", "1")) > 1:
        if spawns:
            raise UserError(f"trainer.strategy={strategy} starts its own processes, but srun already started them: "
                            "use trainer.strategy=ddp (or fsdp)")
        per_node, nodes = env.get("SLURM_NTASKS_PER_NODE", ""), env.get("SLURM_NNODES", "")
        per_node = per_node.split("(")[0]  # "4(x2)" on heterogeneous allocations
        if n is not None and per_node.isdigit() and int(per_node) != n:
            raise UserError(f"srun started {per_node} tasks per node but trainer.devices={devices}: set "
                            f"trainer.devices={per_node}, or #SBATCH --ntasks-per-node={n} (one task per device)")
        if nodes.isdigit() and int(nodes) != num_nodes:
            raise UserError(f"the SLURM job has {nodes} nodes but trainer.num_nodes={num_nodes}: set "
                            f"trainer.num_nodes={nodes}, or #SBATCH --nodes={num_nodes}")
