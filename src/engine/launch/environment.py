"""Who started this process (torchrun, SLURM's srun or sbatch, submitit, or us). No torch imports.

Processes started by an external launcher each compose their own config, so anything they must agree on (the run
dir) comes from the launcher's environment."""

import os

# SLURM's step id of the batch script itself (0xfffffffe); srun steps count 0, 1, 2, ...
_SLURM_BATCH_STEP = "4294967294"


# The pid of the process that started this machine's other ranks and watches them (engine.launch.ranks): set
# before it starts them, so that they inherit it.
WATCHED_BY = "PROJECT_RANKS_WATCHED_BY"


def watched_rank() -> bool:
    """A rank that this machine's rank 0 started and watches: rank 0 says on the console how the run ended (or that
    this rank died, and where its log is); this one writes its lines into its own log."""
    return os.environ.get(WATCHED_BY, str(os.getpid())) != str(os.getpid())


def global_rank() -> int:
    """This process's rank as an external launcher numbered it (torchrun's RANK, srun's SLURM_PROCID); 0 otherwise,
    also for the ranks our own launcher starts (engine.launch.ranks: watched_rank says those)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit() and (name != "SLURM_PROCID" or under_slurm()):
            return int(value)
    return 0


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


# Read as this process starts: Lightning's launcher later writes NODE_RANK into rank 0's own environment
_LAUNCHED_BY = [name for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "NODE_RANK") if name in os.environ]


def launched_from_outside() -> bool:
    """torchrun, SLURM, or nodes started by hand (NODE_RANK): each process's command is the launcher's or the user's,
    not one `python train.py` that started the others."""
    return bool(_LAUNCHED_BY)


def shares_a_named_dir() -> bool:
    """Nodes started by hand (MASTER_ADDR, NODE_RANK on each): they share the directory the user names."""
    return "NODE_RANK" in os.environ and "MASTER_ADDR" in os.environ


def shared_run_name() -> str | None:
    """A run-dir name every process of one launch computes alike, or None when we launch the ranks ourselves.
    SLURM's is stable across a requeue, so the requeued job finds its checkpoints there."""
    env = os.environ
    if under_torchrun():
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id == "none":  # static rendezvous without --rdzv-id: the local ranks share their agent
            run_id = f"{os.uname().nodename}-{os.getppid()}"
        return f"torchrun_{run_id}"
    step = slurm_step()
    if step is not None:
        return f"slurm_{env['SLURM_JOB_ID']}_{step}"
    return None


def slurm_step() -> str | None:
    """The srun step this process belongs to; None outside SLURM and in the batch script itself."""
    step = os.environ.get("SLURM_STEP_ID", "")
    if under_slurm() and "SLURM_JOB_ID" in os.environ and step.isdigit() and step != _SLURM_BATCH_STEP:
        return step
    return None


def slurm_batch_job() -> str | None:
    """The job id when this process runs in a SLURM batch script without srun (`python train.py` in sbatch)."""
    if under_slurm() and "SLURM_JOB_ID" in os.environ and slurm_step() is None:
        return os.environ["SLURM_JOB_ID"]
    return None
