"""The search space: Hydra sweep expressions as Optuna distributions, and a study name derived from the search.

tag(log, interval(1e-4, 1e-1))  -> FloatDistribution(log=True)
int(interval(16, 256))          -> IntDistribution          (interval() alone gives floats)
choice(32, 64, 128)             -> CategoricalDistribution
range(1, 4)                     -> IntDistribution(1, 3)    (Hydra's range stops before its end)
"""

import hashlib
import re
from typing import Any

from hydra.core.override_parser.types import Override, Transformer

from .errors import SweeperConfigError


def distribution(override: Override) -> Any:
    """An Optuna distribution for a sweep override; None for a plain value (a fixed override)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not override.is_sweep_override():
        return None
    value: Any = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        choices: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        values: list[Any] = list(override.sweep_iterator())
        if all(isinstance(v, int) for v in values) and isinstance(value.step, int):
            return IntDistribution(values[0], values[-1], step=value.step)
        return FloatDistribution(float(values[0]), float(values[-1]), step=float(value.step))
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise SweeperConfigError(f"{override.input_line}: not supported by the Optuna sweeper")


def split(overrides: list[Override]) -> tuple[dict[str, Any], list[str]]:
    """(search space, fixed overrides). A later override of a key wins: the command line over the config."""
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in overrides:
        key, dist = override.get_key_element(), distribution(override)
        if dist is None:
            space.pop(key, None)
            fixed[key] = str(override.input_line)
        else:
            fixed.pop(key, None)
            space[key] = dist
    return space, list(fixed.values())


def suggest(trial: Any, name: str, dist: Any) -> Any:
    """One value for `name`, through Optuna's public suggest_* API."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def study_name(base: str, space: dict[str, Any], fixed: list[str], direction: str) -> str:
    """`<base>-<8 hex>` from what makes two searches different (space, fixed overrides, direction), so the same
    command resumes its study and another search never mixes its trials into it. The trial count and the
    launcher are Hydra overrides, not part of the search: raising n_trials continues the same study."""
    from optuna.distributions import distribution_to_json

    identity = "\n".join(
        [direction, *(f"{k}: {distribution_to_json(d)}" for k, d in sorted(space.items())), *sorted(fixed)]
    )
    return f"{base}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def quoted(value: Any) -> str:
    """A value as a quoted Hydra override string (URLs and paths hold ':', '/', ',', '=').
    Hydra unescapes backslashes only before a quote (and at the end): escape just those."""
    text = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', str(value))
    return '"' + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + '"'
