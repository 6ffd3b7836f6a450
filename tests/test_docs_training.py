"""The commands of the documentation pages that tests/test_readme.py's PAGES gives this file, each page in a fresh
copy of its own (tests/test_readme.py says how they run)."""

from pathlib import Path

import pytest
from test_readme import page_cases, run_page_command

pytestmark = pytest.mark.slow

CASES = page_cases(__file__)


@pytest.fixture(scope="module")
def copies() -> dict[str, Path]:
    return {}


@pytest.mark.parametrize(("page", "command", "expected"), CASES)
def test_doc_command(copies, tmp_path_factory, page, command, expected):
    run_page_command(copies, tmp_path_factory, page, command, expected)
