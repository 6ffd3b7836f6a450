"""What every entry point does around its task: errors as one line, and no half-written output."""

import difflib
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from project.errors import UserError
from project.runs.dirs import remove_if_unused

# Set by the user to see full tracebacks; copied at the first start so launched ranks keep it.
FULL_ERROR = "PROJECT_FULL_ERROR"


def _full_error() -> bool:
    return os.environ.get(FULL_ERROR) == "1"


def _one_line(text: str) -> str:
    text = text.split("Config search path")[0]
    return re.sub(r"\s*\n\s*", " ", text).strip()


def _composition_error(e: CompactHydraException) -> str:
    """Hydra's message plus OmegaConf's cause in one line, with a close key when a key was mistyped."""
    cause = e.__cause__
    parent = getattr(cause, "parent_node", None)
    key = getattr(cause, "key", None)
    if isinstance(parent, DictConfig) and key is not None and "not in struct" in str(cause):
        full_key = getattr(cause, "full_key", key)
        close = difflib.get_close_matches(str(key), [str(k) for k in parent.keys()], n=1)
        hint = (
            f"did you mean {full_key[: -len(str(key))]}{close[0]}?"
            if close
            else f"valid keys: {', '.join(map(str, parent.keys()))}"
        )
        return f"{full_key}: no such key; {hint} (to add a new key on purpose: +{full_key}=...)"
    message = _one_line(str(e))
    if cause is not None:
        message += " " + _one_line(str(cause).split("full_key:")[0])
    return message


def cli(hydra_main: Callable[[], Any]) -> None:
    """Run a @hydra.main function so that mistakes print one line and exit 2 (not 7 lines and 1)."""
    from project.launch.sweeps import remember_entry_script

    os.environ.setdefault(FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
    os.environ["HYDRA_FULL_ERROR"] = "1"  # makes Hydra raise to us instead of printing its own report
    remember_entry_script()
    try:
        hydra_main()
    except (CompactHydraException, UserError) as e:  # UserError arrives here from a failed sweep job
        if _full_error():
            raise
        message = _composition_error(e) if isinstance(e, CompactHydraException) else str(e)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_console_output() -> None:
    """`import lightning` adds a console handler of its own; under Hydra the root logger already prints
    (and writes <run>/<task>.log), so every Lightning message would show twice."""
    if logging.getLogger().handlers:
        for handler in list(logging.getLogger("lightning").handlers):
            if type(handler) is logging.StreamHandler:
                logging.getLogger("lightning").removeHandler(handler)


def run(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Call `task(cfg)`; a UserError leaves no run dir behind and becomes `error: ...` on stderr with exit
    code 2. In a sweep it fails this job only: Hydra records it, runs the other jobs, and reports at the end."""
    _one_console_output()
    try:
        return task(cfg)
    except UserError as e:
        if _full_error():
            raise
        hc = HydraConfig.get()
        remove_if_unused(Path(hc.runtime.output_dir))
        print(f"error: {e}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            raise
        raise SystemExit(2) from None
