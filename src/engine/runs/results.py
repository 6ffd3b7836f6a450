"""A run's final numbers as JSON files in its directory, so scripts and sweeps need not parse TensorBoard. Always
valid JSON: a non-finite metric is null, and `status` says how the stage ended (ok, diverged, interrupted).
"""

import json
import math
from pathlib import Path
from typing import Any


def write_text(path: Path, text: str) -> None:
    """Written whole or not at all (a full disk leaves no half-written JSON)."""
    from engine.runs.atomic_io import write_file

    write_file(path, lambda partial: partial.write_text(text), "free space on that disk, or set paths.log_dir")


def best_key(metric: str) -> str:
    """Where a run's best monitor.metric goes among its metrics (fit_metrics.json): `best/val/acc`."""
    return f"best/{metric}"


def write_metrics(
    trainer: Any, path: Path, status: str = "ok", extra: dict[str, float] | None = None
) -> dict[str, float]:
    """The trainer's final scalar metrics (and `extra` ones); written by rank 0, returned on every rank."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics.update(extra or {})
    if trainer.is_global_zero:
        shown: dict[str, Any] = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        shown["status"] = status
        text = json.dumps(shown, indent=2, sort_keys=True, allow_nan=False) + "\n"
        write_text(path, text)
    return metrics


def read_metrics(run_dir: Path) -> dict[str, float]:
    """What a finished run wrote: its fit metrics, then its test metrics (numbers only)."""
    metrics: dict[str, float] = {}
    for name in ("fit_metrics.json", "test_metrics.json"):
        if (run_dir / name).is_file():
            found = json.loads((run_dir / name).read_text())
            metrics.update({k: float(v) for k, v in found.items() if isinstance(v, (int, float))})
    return metrics
