"""The command that continues a stopped run, as its stop line says it (engine.callbacks.checks): pasted as it is,
it resumes from the checkpoint just saved, with the run's own settings."""

import json
import os
import re
import shlex
from pathlib import Path

from engine.launch.environment import launched_from_outside


def resume_override(path: str) -> str:
    """`ckpt_path=<path>` as Hydra reads it back: quoted where the path has what its grammar splits on or rejects (a
    space, a comma, a bracket, a letter outside ASCII), which the shell's quoting alone does not protect."""
    if re.fullmatch(r"[\w./\-+:@%]+", path, flags=re.ASCII):
        return f"ckpt_path={path}"
    # in Hydra's quotes a backslash is itself, except the ones before a quote or at the end, which are doubled
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, path).replace("'", "\\'")
    return f"ckpt_path='{escaped}'"


def continue_command(path: str) -> str:
    """A plain run: its command with its own overrides (a resume with other settings is refused) and `ckpt_path=<path>`.
    A sweep job or a torchrun/SLURM/by-hand run: `ckpt_path=<path>`, to add to the command that started it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from engine.console import PROFILE

    resume = resume_override(path)
    # torchrun, SLURM, nodes started by hand: each process's command is the launcher's, not ours to rebuild
    if not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN or launched_from_outside():
        return f"{resume} added to the run's command"
    overrides = list(HydraConfig.get().overrides.task)
    key = lambda override: override.lstrip("+~").split("=", 1)[0]  # noqa: E731
    tuned: list[str] = []
    if any(key(o) == "tune" or key(o).startswith("tune.") for o in overrides):
        tuned = _tuned_override(Path(HydraConfig.get().runtime.output_dir))
        if not tuned:
            return f"{resume} added to the run's command"
    # a resume tunes nothing (tune with ckpt_path is refused): the value the finder found, as the override it wrote
    left_out = re.compile(r"ckpt_path|paths\.output_dir|callbacks\.[^.]+\.dirpath|logger\.[^.]+\.save_dir|tune(\..*)?")
    profile = f"profile={os.environ.get(PROFILE)}"
    kept = [o for o in overrides if o != profile and not left_out.fullmatch(key(o))]
    kept = [o for o in kept if not tuned or key(o) != key(tuned[0])]
    return shlex.join(["python", "train.py", *kept, *tuned, resume])


def _tuned_override(run_dir: Path) -> list[str]:
    """The override of the value a `tune=... tune.apply=true` run trained with (engine.tasks.tune's tune.json)."""
    try:
        override = json.loads((run_dir / "tune.json").read_text()).get("override")
    except (OSError, ValueError, AttributeError):
        return []
    return [override] if isinstance(override, str) and "=" in override else []
