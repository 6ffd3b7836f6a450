"""Who starts the processes (us, torchrun, srun, submitit, a sweep) and what that requires of a run."""
