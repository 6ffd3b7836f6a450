"""Who started this process (torchrun, SLURM's srun, submitit, or us), and what that implies. No torch imports.

Processes started by an external launcher each compose their own config, so anything they must agree
on (the run dir) comes from the launcher's environment, and the trainer's devices x num_nodes must
match the processes the launcher made. Checked here, before the Trainer, with the flags that fix it.
"""

import os
from typing import Any

from project.errors import UserError


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def under_slurm() -> bool:
    """Lightning's own SLURM test: srun/sbatch set SLURM_NTASKS; interactive shells do not count."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def under_submitit() -> bool:
    """A job started by submitit (hydra/launcher=slurm). submitit handles preemption and requeue itself."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def restarted() -> bool:
    """This process belongs to a job that was started before and is running again: a SLURM requeue (by
    Lightning or by submitit) or a torchelastic restart. Only then does a run continue from its own dir."""
    return (
        int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    )


def shared_run_name() -> str | None:
    """A run-dir name every process of one launch computes alike, or None when we launch the ranks ourselves.

    SLURM's is stable across a requeue, so the requeued job finds its checkpoints there.
    """
    env = os.environ
    if under_torchrun():
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id == "none":  # static rendezvous without --rdzv-id: the local ranks share their agent
            run_id = f"{os.uname().nodename}-{os.getppid()}"
        return f"torchrun_{run_id}"
    if under_slurm() and "SLURM_JOB_ID" in env:
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
    if isinstance(strategy, str) and ("spawn" in strategy or strategy in ("ddp_fork", "ddp_notebook", "dp")):
        raise UserError(
            f"trainer.strategy={strategy} runs its own processes, but {launcher} already started "
            f"{started}: use trainer.strategy=ddp (or fsdp)"
        )
    n = _count(devices)
    if launcher == "srun":
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
