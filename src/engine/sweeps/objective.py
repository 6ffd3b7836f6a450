"""What a sweep optimizes, and which way: a form of `monitor.metric`, better as `monitor.mode` says. One source for the
summary's order, the Optuna study's direction and name, and the metric its pruner judges each epoch (checkpoints and
early stopping follow monitor.metric too): an `optimized_metric` of another metric would be ranked the wrong way.
"""

from typing import Any

from omegaconf import OmegaConf

from engine.errors import UserError
from engine.runs.results import best_key

PRUNING = "engine.sweeps.pruning.OptunaPruning"


def _select(cfg: Any, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)


def metric(cfg: Any) -> str:
    """What each job returns to the sweeper (engine.tasks.training): optimized_metric, else the best monitor.metric."""
    return str(_select(cfg, "optimized_metric") or best_key(str(_select(cfg, "monitor.metric") or "val/acc")))


def forms(monitor: str) -> tuple[str, ...]:
    """monitor.metric as a run returns it: its best (best/val/acc, or a module's own val/acc_best), or its last."""
    return best_key(monitor), monitor, f"{monitor}_best"


def refusal(cfg: Any) -> UserError | None:
    """Why this sweep's jobs would be judged by two metrics (one line naming the fix), or None."""
    monitor, mode = _select(cfg, "monitor.metric"), _select(cfg, "monitor.mode")
    chosen = _select(cfg, "optimized_metric")
    if monitor is None:
        return None
    if chosen and chosen not in forms(str(monitor)):
        return UserError(
            f"optimized_metric={chosen} is not monitor.metric ({monitor}): a sweep ranks its jobs as monitor.mode "
            f"({mode}) says, and checkpoints, early stopping and the pruner judge monitor.metric; set "
            f"monitor.metric={chosen} monitor.mode=<max or min> instead (and leave optimized_metric unset)"
        )
    for name in _select(cfg, "callbacks") or {}:
        judged = _select(cfg, f"callbacks.{name}.monitor")
        if _select(cfg, f"callbacks.{name}._target_") == PRUNING and judged not in (None, monitor):
            return UserError(
                f"callbacks.{name}.monitor={judged}: the pruner would judge another metric than the study optimizes "
                f"({monitor}); set callbacks.{name}.monitor=${{monitor.metric}}"
            )
    return None
