"""Shared fixtures: run the real entry points in a subprocess, or compose configs in-process."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from project.config import register

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

register()


def run_dirs(log_dir: Path, task: str = "train") -> list[Path]:
    return sorted(p for p in (log_dir / task / "runs").glob("*") if p.is_dir())


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run `python <script> <overrides>` from the repo root with logs and data under tmp_path."""

    def run(script: str, *overrides: str, check: bool = True, env: dict | None = None, log_dir: Path | None = None):
        log_dir = log_dir or tmp_path / "logs"
        cmd = [
            sys.executable,
            str(REPO / script),
            f"paths.log_dir={log_dir}",
            f"paths.data_dir={tmp_path / 'data'}",
            *overrides,
        ]
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=full_env)
        if check and proc.returncode != 0:
            output = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{output}")
        return proc

    return run


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., DictConfig]:
    """Compose conf/<name>.yaml with overrides, paths pointed into tmp_path (no Hydra run needed)."""

    def make(*overrides: str, name: str = "train") -> DictConfig:
        paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'out'}"]
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            cfg = compose(name, overrides=[*paths, *overrides])
        (tmp_path / "out").mkdir(exist_ok=True)
        return cfg

    return make
