"""The Optuna sweeper's search space: Hydra's sweep expressions as Optuna distributions, checked before a sweep dir
or a study exists (hydra_plugins.engine_optuna_sweeper.space)."""

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import UserError
from hydra_plugins.engine_optuna_sweeper.space import distribution


def parsed(expression: str):
    (override,) = OverridesParser.create().parse_overrides([f"model.optimizer.lr={expression}"])
    return override


@pytest.mark.parametrize(
    "expression",
    ["interval(0.1,0.01)", "tag(log,interval(0,1))", "int(interval(256,32))", "range(5,1)", "range(0,1,-1)"],
)
def test_a_space_optuna_cannot_draw_from_is_one_line_naming_the_override(expression):
    with pytest.raises(UserError, match=r"^model.optimizer.lr=.*change the search space$") as info:
        distribution(parsed(expression))
    assert "\n" not in str(info.value)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    start=st.one_of(st.integers(-50, 50), st.floats(-5, 5)),
    length=st.one_of(st.integers(1, 40), st.floats(0.01, 8)),
    step=st.one_of(st.integers(1, 7), st.floats(0.05, 3)),
)
def test_a_range_is_the_values_hydra_lists_computed_not_listed(start, length, step):
    """The distribution's bounds and step are those of the values Hydra's own range steps through, after Optuna's
    own arithmetic: it dropped the last value of about half of all float ranges (range(0,3,1.3542207771404198))."""
    override = parsed(f"range({start},{start + length},{step})")
    values = list(override.sweep_iterator())
    found = distribution(override)
    assert (found.low, found.step) == (values[0], step)
    assert found.high == pytest.approx(values[-1], rel=1e-9, abs=1e-9)


def test_every_value_of_a_float_range_can_be_drawn_in_a_trial():
    import optuna

    found = distribution(parsed("range(0,3,1.3542207771404198)"))  # 0, 1.354..., 2.708...
    from hydra_plugins.engine_optuna_sweeper.space import suggest

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))  # the sweeper's default
    study.optimize(lambda trial: suggest(trial, "x", found), n_trials=30)
    drawn = sorted({t.params["x"] for t in study.trials})
    assert drawn == pytest.approx([0.0, 1.3542207771404198, 2.7084415542808395])


def test_a_range_of_a_billion_values_is_a_distribution_at_once_and_too_many_to_shuffle_is_one_line():
    """It was listed first: range(0,1e9,1e-9) hung the sweep before any trial."""
    assert distribution(parsed("range(0,1000000000,1)")).high == 999_999_999
    assert distribution(parsed("range(0.0,1000000.0,0.000001)")).step == 0.000001
    with pytest.raises(UserError, match="at most 10000 choices"):
        distribution(parsed("shuffle(range(0,1000000000))"))
