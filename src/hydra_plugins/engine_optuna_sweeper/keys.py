"""The search space against the composed config, before a sweep dir or a study exists: every searched key must be in
the trials' config (or be added with `+`), a searched config group must have each option, and a key whose value is an
int (or a bool) must not be given floats. Otherwise each trial failed with its own error, after the study was made.
"""

import math
from typing import Any, Callable

from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import SweeperConfigError

_ABSENT = object()


def _text(override: Override) -> str:
    """The sweep expression as written: `interval(8,64)` of `data.batch_size=interval(8,64)`."""
    return str(override.input_line).partition("=")[2].strip()


def check(
    searched: dict[str, Override],
    dists: dict[str, Any],
    fixed: list[str],
    where: Callable[[str], str],
    group_options: Callable[[str], list[str]],
    compose: Callable[[list[str]], DictConfig],
) -> None:
    """Refuse, in one line naming the override and the fix, a search the trials' config cannot take. `where(key)`
    says where an override came from ("" for the command line); `compose(overrides)` is the trials' config."""
    groups: dict[str, list[str]] = {}
    for key, override in searched.items():
        group = override.key_or_group.replace(".", "/")
        try:
            options = group_options(group)  # [] for a key that is not a config group
        except Exception:
            options = []
        if not options:
            continue
        choices = getattr(dists[key], "choices", None)
        if choices is None:
            raise SweeperConfigError(
                f"{override.input_line}{where(key)}: {group} is a config group, whose options are names; "
                f"use choice(...) of {', '.join(options)}"
            )
        unknown = [str(c) for c in choices if str(c) not in options]
        if unknown:
            raise SweeperConfigError(
                f"{override.input_line}{where(key)}: {group} has no option {', '.join(unknown)}; its options: "
                f"{', '.join(options)}"
            )
        groups[key] = [str(c) for c in choices]
    values = {k: o for k, o in searched.items() if k not in groups and not k.startswith("hydra.")}
    if not values:
        return
    # one config per option of each searched group (the other groups at their first), as the trials compose it
    first = [f"{searched[k].get_key_element()}={c[0]}" for k, c in groups.items()]
    variants = [first] + [
        [f"{searched[k].get_key_element()}={c}" if i == j else f for j, f in enumerate(first)]
        for i, (k, cs) in enumerate(groups.items())
        for c in cs[1:]
    ]
    for variant in variants:
        try:
            cfg = compose([*fixed, *variant])
        except Exception as e:
            said = " ".join(str(e).split())
            raise SweeperConfigError(
                f"the trials' config cannot be composed with {' '.join([*fixed, *variant]) or 'no overrides'}: {said}"
            ) from e
        for key, override in values.items():
            _check_key(cfg, key, override, dists[key], where(key), variant)


def _check_key(cfg: DictConfig, key: str, override: Override, dist: Any, where: str, variant: list[str]) -> None:
    value = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False, throw_on_resolution_failure=False)
    with_groups = f" (with {' '.join(variant)})" if variant else ""
    if value is _ABSENT and override.type == OverrideType.CHANGE:
        raise SweeperConfigError(
            f"{override.input_line}{where}: the config has no {key}{with_groups}, so every trial would fail; search "
            f"a key it has, or add this one with +{key}={_text(override)}"
        )
    if value is not _ABSENT and override.type == OverrideType.ADD:
        raise SweeperConfigError(
            f"{override.input_line}{where}: the config has {key} already ({value!r}), and + only adds a new key; "
            f"use {key}={_text(override)}"
        )
    if value is _ABSENT or "float(" in _text(override):  # float(...): floats asked for, whatever the value
        return
    if isinstance(value, (ListConfig, DictConfig)) and _draws_numbers(dist):
        kind = "a list" if isinstance(value, ListConfig) else "a mapping"
        shown = OmegaConf.to_container(value)
        raise SweeperConfigError(
            f"{override.input_line}{where}: {key} is {kind} ({shown}){with_groups}, but this draws numbers; search "
            f"whole values of its kind, e.g. {key}=choice({shown},...)"
        )
    floats = _draws_floats(dist)
    if isinstance(value, bool) and (floats or _draws_numbers(dist)):
        raise SweeperConfigError(
            f"{override.input_line}{where}: {key} is a bool ({value}), this draws numbers; use choice(true,false)"
        )
    if isinstance(value, int) and not isinstance(value, bool) and floats:
        raise SweeperConfigError(
            f"{override.input_line}{where}: {key} is an int ({value}){with_groups}, but this draws floats such as "
            f"{floats}; use {key}={_int_form(override)} (or float(...) if {key} takes floats)"
        )


def _draws_floats(dist: Any) -> Any:
    """A float the distribution can draw (its low end, or a non-integral one), or None when it draws ints only."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    if isinstance(dist, FloatDistribution):
        middle = dist.low + (dist.high - dist.low) / math.pi  # an unround value in it
        if dist.step is not None:
            middle = dist.low + dist.step * math.floor((middle - dist.low) / dist.step)
        return float(f"{middle:.3g}")
    if isinstance(dist, CategoricalDistribution):
        return next((c for c in dist.choices if isinstance(c, float)), None)
    return None


def _draws_numbers(dist: Any) -> bool:
    from optuna.distributions import CategoricalDistribution

    if isinstance(dist, CategoricalDistribution):
        return any(isinstance(c, (int, float)) and not isinstance(c, bool) for c in dist.choices)
    return True


def _int_form(override: Override) -> str:
    """The same search as ints, in the sweeper's grammar: int(interval(...)), int(choice(...)), or a range of
    integer steps (Hydra's int() of a range makes its step 0)."""
    value: Any = override.value()
    if override.is_range_sweep():
        step = 1 if value.step is None else max(1, round(value.step))
        inner = f"range({math.floor(value.start)}, {math.ceil(value.stop)}, {step})"
        return f"shuffle({inner})" if value.shuffle else inner
    return f"int({_text(override)})"
