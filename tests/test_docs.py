"""The documentation as a whole: README.md and the site in docs/ (mkdocs.yml) stay in step with each other, with the
tests that run their commands (tests/test_readme.py, tests/test_docs_*.py) and with the tree (docs/layout.md).

The commands of the pages this file is named for in test_readme.PAGES (those with few or cheap commands) run here
too, as tests/test_docs_*.py run the others'."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS
from test_readme import DOCS, ELSEWHERE, PAGES, README, doc_commands, page_cases, run_page_command

DOCUMENTS = [README, *sorted(DOCS.glob("*.md"))]


def _nav_pages(nav: list) -> list[str]:
    """The Markdown files of mkdocs.yml's nav, in order, sections opened up."""
    found = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def _prose(text: str) -> str:
    """A Markdown text without its fenced code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_page_is_in_the_nav_once_and_run_by_one_test_file():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == pages, "mkdocs.yml's nav and docs/*.md disagree"
    assert sorted(PAGES) == pages, "tests/test_readme.py's PAGES and docs/*.md disagree"
    for page, runner in PAGES.items():
        assert (TESTS / runner).is_file() and "page_cases(__file__)" in (TESTS / runner).read_text(), (page, runner)


def test_every_command_that_cannot_run_here_is_covered_by_a_named_test():
    skipped = {command for path in DOCUMENTS for command, _, runs in doc_commands(path) if not runs}
    assert sorted(skipped) == sorted(ELSEWHERE), "the documents and ELSEWHERE disagree"
    for command, where in ELSEWHERE.items():
        path, _, test = where.partition("::")
        text = (REPO / path).read_text()
        covered = {"make test-fast": "make test"}.get(command, command)  # make test runs every test-fast test
        assert (f"def {test}(" in text) if test else (covered in text.splitlines()), f"{command}: {where}"


def test_the_readme_is_a_short_guide_that_says_how_to_install_and_test():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "make install" in text and "make test" in text
    contents = text[: text.index("\n## ")]  # the table of contents, before the first section
    sections = re.findall(r"^## (.+)$", text, re.M)
    for section in sections[:-1]:  # all but the licence
        anchor = re.sub(r"[^\w\- ]", "", section.lower()).replace(" ", "-")
        assert f"[{section}](#{anchor})" in contents, section
    linked = re.findall(r"\]\((docs/[^)#]+)", text)
    assert linked and not [link for link in linked if not (REPO / link).is_file()], linked


def test_the_readmes_strategies_table_names_only_commands_the_pages_run():
    """The README's one table of devices and strategies shows commands in its cells, where no test would run them:
    each must be a command of a page's code blocks (run there, or mapped in ELSEWHERE)."""
    text = README.read_text()
    section = text[text.index("## Devices and strategies") :]
    section = section[: section.index("\n## ", 1)]
    documented = {command for path in DOCUMENTS for command, _, _ in doc_commands(path)}
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| `trainer=` |")]
    shown = [c for row in rows for c in re.findall(r"`([^`]+)`", row.rsplit("|", 2)[-2])]
    programs = [c for c in shown if re.match(r"(python|torchrun|sbatch|[A-Z_]+=\S+ python) ", c)]
    assert len(programs) >= 8, shown
    missing = [c for c in programs if c not in documented]
    assert not missing, f"not in any page's code block: {missing}"


def test_no_dated_timings_or_history_in_the_documents():
    """Numbers stay where a test or a benchmark result file backs them; dates, issue numbers and "was X before"
    belong in git's history, not in the guide."""
    for path in DOCUMENTS:
        prose = _prose(path.read_text())
        for pattern in (r"\b20\d\d-\d\d-\d\d\b", r"\bissue \d+", r"\bmeasured on\b", r"\bbefore the\b.*\bwas\b"):
            found = re.search(pattern, prose, re.I)
            assert not found, f"{path.name}: {found.group(0)!r}"


def _layout() -> list[str]:
    """The paths docs/layout.md names: each table row's first cell, under the folder its heading names."""
    folder, named = "", []
    for line in (DOCS / "layout.md").read_text().splitlines():
        heading = re.match(r"^#+ (?:`([^`]+)`|.*)", line)
        if heading:
            folder = heading.group(1) or ""
            continue
        cell = re.match(r"^\| `([^`]+)` \|", line)
        if cell:
            named.append(folder + cell.group(1))
    return named


def test_the_layout_names_every_file_under_src_and_nothing_that_is_not_there():
    named = _layout()
    assert len(named) == len(set(named)), "a file named twice"
    missing = [name for name in named if not (REPO / name).exists()]
    assert not missing, f"docs/layout.md names what the tree does not hold: {missing}"
    tracked = subprocess.run(["git", "ls-files", "src", "conf"], cwd=REPO, capture_output=True, text=True, check=True)
    files = tracked.stdout.splitlines()
    unnamed = [f for f in files if f.startswith("src/") and f not in named]
    assert not unnamed, f"files under src/ that docs/layout.md does not name: {unnamed}"
    top_of_conf = {
        "conf/" + f.split("/")[1] + ("/" if f.count("/") > 1 else "") for f in files if f.startswith("conf/")
    }
    assert not top_of_conf - set(named), f"conf/ entries docs/layout.md does not name: {top_of_conf - set(named)}"


CASES = page_cases(__file__)


@pytest.fixture(scope="module")
def copies() -> dict[str, Path]:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(("page", "command", "expected"), CASES)
def test_doc_command(copies, tmp_path_factory, page, command, expected):
    run_page_command(copies, tmp_path_factory, page, command, expected)


def test_the_readmes_net_node_is_the_one_of_the_file_it_says_to_copy():
    """A blind new-user try copied conf/model/tiny_cnn.yaml and found other arguments than the README showed."""
    (block,) = re.findall(r"```yaml\n(net:.*?)```", README.read_text(), re.S)
    shown = yaml.safe_load(block)["net"]
    copied = yaml.safe_load((REPO / "conf" / "model" / "tiny_cnn.yaml").read_text())["net"]
    assert shown == copied
