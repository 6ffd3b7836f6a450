"""`make install` installs exactly requirements.lock, and the lock still satisfies pyproject.toml's ranges."""

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = REPO / "requirements.lock"


def _locked() -> dict[str, str]:
    """name -> version for the lines of the lock that apply to this interpreter and platform."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9_.\-]+)==([^ ;\\]+)\s*(?:;\s*(.*?))?\s*\\?$", line)
        if found and (found[3] is None or Marker(found[3]).evaluate()):
            pins[canonicalize_name(found[1])] = found[2]
    return pins


def test_the_environment_holds_exactly_the_locked_versions():
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    pins = _locked()
    assert len(pins) > 100 and "torch" in pins and "lightning" in pins
    wrong = {name: (version, installed.get(name)) for name, version in pins.items() if installed.get(name) != version}
    assert not wrong, f"locked vs installed (run make install): {wrong}"
    lines = LOCK.read_text().splitlines()
    unhashed = [a for a, b in zip(lines, lines[1:]) if re.match(r"^[A-Za-z0-9]", a) and "--hash=sha256:" not in b]
    assert not unhashed, f"pins without a hash (run make lock): {unhashed}"


def test_the_lock_satisfies_the_ranges_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [
        r for extra in ("slurm", "trackers") for r in project["optional-dependencies"][extra]
    ]
    pins = _locked()
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is in pyproject.toml but not in requirements.lock: run make lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {text}"


def test_make_knows_install_lock_and_upgrade():
    dry = subprocess.run(["make", "-n", "install", "lock", "upgrade"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "--require-hashes" in dry.stdout and "--output-file requirements.lock" in dry.stdout
    assert Path(sys.executable).parent.joinpath("uv").is_file()


def test_the_installed_packages_are_compiled_to_bytecode():
    """Every process of a run, a sweep or the tests imports lightning (some 1,800 modules with torch's): compiled
    by `make install`, not again in each process where $PYTHONDONTWRITEBYTECODE keeps Python from caching it."""
    import importlib.util

    for name in ("lightning.pytorch.trainer.trainer", "torchmetrics.metric", "hydra._internal.config_loader_impl"):
        source = importlib.util.find_spec(name).origin
        assert Path(importlib.util.cache_from_source(source)).is_file(), f"{source} has no bytecode: run make install"


def test_make_help_lists_every_target_with_what_it_does():
    import re
    import subprocess

    phony = re.search(r"^\.PHONY: (.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()  # type: ignore[union-attr]
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(REPO)], capture_output=True, text=True, check=True)
    listed = {
        line.split()[1]: line.split(None, 2)[2] for line in proc.stdout.splitlines() if line.startswith("  make ")
    }
    assert set(listed) == set(phony) and all(listed.values())  # `make` alone is `make help`


def _blocks(*names: str) -> str:
    """The lock's lines for `names`: each pin with its hash lines."""
    text, found = LOCK.read_text(), []
    for name in names:
        found.append(re.search(rf"^{name}==.*?(?=^\S)", text, re.M | re.S).group(0))  # type: ignore[union-attr]
    return "".join(found)


def test_make_install_checks_every_hash_again_when_the_lock_changed(tmp_path):
    """uv trusts what a venv holds: a hash corrupted in the lock after an install passed, exit 0."""
    venv, lock = tmp_path / "venv", tmp_path / "test.lock"
    make = ["make", "--no-print-directory", "-C", str(REPO), "install", f"VENV={venv}", f"LOCK={lock}"]
    lock.write_text(_blocks("uv", "idna"))
    first = subprocess.run(make, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    idna = _blocks("idna")
    lock.write_text(_blocks("uv") + re.sub(r"sha256:([0-9a-f]+)", lambda m: "sha256:" + m[1][::-1], idna))
    again = subprocess.run(make, capture_output=True, text=True)
    assert again.returncode != 0 and "Hash mismatch for `idna" in again.stderr, again.stderr[-3000:]
    assert (venv / "installed.lock").read_text() == _blocks("uv", "idna")  # the lock installed, still
    lock.write_text(_blocks("uv", "idna"))
    assert subprocess.run(make, capture_output=True).returncode == 0
