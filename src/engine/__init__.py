"""The engine under the template: safe checkpoints, exact resume, one-line errors, run directories, strategies,
launch, sweeps and trackers. It never imports the user's project (src/project)."""
