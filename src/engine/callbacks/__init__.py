"""Callbacks that hook into runs: Lightning's (pruning an Optuna trial) and Hydra's (device slots of sweep jobs)."""
