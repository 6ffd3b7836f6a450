"""What every entry point does around its task: user errors as one line, and no half-written output."""

import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from project.errors import UserError


def _only_bookkeeping(run_dir: Path) -> bool:
    """True when the dir holds nothing a user would want: Hydra's .hydra/, log files, empty dirs."""
    for path in run_dir.rglob("*"):
        if path.is_file() and ".hydra" not in path.relative_to(run_dir).parts and path.suffix != ".log":
            return False
    return True


def _one_console_output() -> None:
    """`import lightning` adds a console handler of its own; under Hydra the root logger already prints
    (and writes <run>/<task>.log), so every Lightning message would show twice."""
    if logging.getLogger().handlers:
        for handler in list(logging.getLogger("lightning").handlers):
            if type(handler) is logging.StreamHandler:
                logging.getLogger("lightning").removeHandler(handler)


def run(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Call `task(cfg)`; a UserError becomes `error: ...` on stderr, exit code 2, and no leftover run dir."""
    _one_console_output()
    try:
        return task(cfg)
    except UserError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if run_dir.is_dir() and _only_bookkeeping(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
