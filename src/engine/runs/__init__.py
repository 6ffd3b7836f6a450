"""A run's directory and what it holds: naming, resume policy, checkpoints, final metrics."""
