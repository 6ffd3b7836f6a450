"""The search space: Hydra sweep expressions as Optuna distributions (`tag(log, interval(...))`: log float;
`int(interval(...))`: int; `choice(...)`: categorical; `range(1, 4)`: IntDistribution(1, 3), as Hydra's range stops
before its end), and a study name derived from the search.
"""

import decimal
import hashlib
import itertools
import math
import re
import warnings
from typing import Any

from hydra.core.override_parser.types import Override, Transformer

from .errors import SweeperConfigError


def distribution(override: Override) -> Any:
    """An Optuna distribution for a sweep override; None for a plain value. What Optuna refuses is one line naming the
    override, said before a sweep dir or a study exists."""
    if not override.is_sweep_override():
        return None
    try:
        return _distribution(override)
    except (ValueError, TypeError, OverflowError) as e:
        reason = " ".join(str(e).split()).rstrip(".")
        raise SweeperConfigError(f"{override.input_line}: {reason}; change the search space") from e


def _distribution(override: Override) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value: Any = override.value()
    if override.is_range_sweep():
        first, last, count = _range_bounds(override)
        if value.shuffle:
            if count > MAX_CHOICES:
                raise ValueError(f"shuffle of {count} values; at most {MAX_CHOICES} choices")
            return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))  # type: ignore[arg-type]
        if all(isinstance(v, int) for v in (value.start, value.step)):
            return IntDistribution(first, last, step=value.step)
        return stepped(float(first), float(last), float(value.step))
    if override.is_choice_sweep():
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))  # type: ignore[arg-type]
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise SweeperConfigError(f"{override.input_line}: not supported by the Optuna sweeper")


MAX_CHOICES = 10_000


def _range_bounds(override: Override) -> tuple[Any, Any, int]:
    """(first, last, how many) of Hydra's range(start, stop, step), which stops before `stop`: listed as Hydra would up
    to MAX_CHOICES values, computed beyond (a billion steps is a distribution, not a list to build)."""
    value: Any = override.value()
    start, stop, step = value.start, value.stop, 1 if value.step is None else value.step
    if not all(math.isfinite(v) for v in (start, stop, step)):
        raise ValueError(f"range({start}, {stop}, {step}) needs finite numbers")
    if step <= 0:
        raise ValueError(f"range({start}, {stop}, {step}) needs a step above 0")
    listed = list(itertools.islice(value.range(), MAX_CHOICES + 1))
    if not listed:
        raise ValueError(f"range({start}, {stop}, {step}) holds no value (it stops before its end)")
    if len(listed) <= MAX_CHOICES:
        return listed[0], listed[-1], len(listed)
    if all(isinstance(v, int) for v in (start, stop, step)):
        count = -(-(stop - start) // step)
        return start, start + (count - 1) * step, count
    first, step_ = decimal.Decimal(start), decimal.Decimal(step)
    count = math.ceil((decimal.Decimal(stop) - first) / step_)
    return float(start), float(first + (count - 1) * step_), count


def stepped(low: float, high: float, step: float) -> Any:
    """FloatDistribution(low, high, step) that keeps `high`: Optuna's floor division silently drops it for about half
    of float steps, so it gets half a step more (Optuna's warning about it is expected)."""
    from optuna.distributions import FloatDistribution

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not divisible by `step`")
        return FloatDistribution(low, high + step / 2, step=step)


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
    if dist.step is not None:  # the same half step as stepped(), or Optuna drops the last value here too
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is not divisible by `step`")
            return trial.suggest_float(name, dist.low, dist.high + dist.step / 2, step=dist.step)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)


def study_name(base: str, space: dict[str, Any], fixed: list[str], direction: str, metric: str) -> str:
    """`<base>-<8 hex>` from the space, fixed overrides, the metric the trials return and its direction: the same
    command resumes its study, another (or the same command after a config file changed the metric) never mixes into
    it; n_trials and the launcher are not part of it, so raising n_trials continues the study."""
    from optuna.distributions import distribution_to_json

    identity = "\n".join(
        [
            direction,
            f"metric: {metric}",
            *(f"{k}: {distribution_to_json(d)}" for k, d in sorted(space.items())),
            *sorted(fixed),
        ]
    )
    return f"{base}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def quoted(value: Any) -> str:
    """A value as a quoted Hydra override string (URLs and paths hold ':', '/', ',', '=').
    Hydra unescapes backslashes only before a quote (and at the end): escape just those."""
    text = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', str(value))
    return '"' + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + '"'
