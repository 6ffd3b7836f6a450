"""Hydra sweeper on current Optuna: `hydra/sweeper=project_optuna`. Nothing heavy is imported at module level:
Hydra imports every module under hydra_plugins at every start (also for --help and --cfg)."""
