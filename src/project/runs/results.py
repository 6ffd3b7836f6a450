"""A run's final numbers as JSON files in its directory, so scripts and sweeps need not parse TensorBoard."""

import json
from pathlib import Path
from typing import Any


def write_metrics(trainer: Any, path: Path) -> dict[str, float]:
    """The trainer's final scalar metrics; written by rank 0, returned on every rank."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if trainer.is_global_zero:
        path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def read_metrics(run_dir: Path) -> dict[str, float]:
    """What a finished run wrote: its fit metrics, then its test metrics."""
    metrics: dict[str, float] = {}
    for name in ("fit_metrics.json", "test_metrics.json"):
        if (run_dir / name).is_file():
            metrics.update(json.loads((run_dir / name).read_text()))
    return metrics
