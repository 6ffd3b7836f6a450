"""The README's commands from "Devices and strategies" on, as tests/test_readme.py runs the first half: in a
fresh copy of their own, so that the two halves can run at the same time (make test runs two test files at
once)."""

from pathlib import Path

import pytest
from test_readme import fresh_copy, readme_commands, run_command

pytestmark = pytest.mark.slow

RUNNABLE = [(c, e) for c, e, runs in readme_commands(half=2) if runs]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A fresh copy, with the digits as PNG files made by the first half's command (README, *Predict*)."""
    work = fresh_copy(tmp_path_factory)
    run_command(work, "python -m project.data.digit_images data/digit_images", None)
    return work


@pytest.mark.parametrize(("command", "expected"), RUNNABLE, ids=[c for c, _ in RUNNABLE])
def test_readme_command(workdir, command, expected):
    run_command(workdir, command, expected)
