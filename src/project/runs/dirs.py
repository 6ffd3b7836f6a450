"""Where a run writes: its directory's name, claimed atomically, and removed again if the run never started.

Imports no torch: Hydra resolves these names before any task code runs.
"""

import os
import shutil
from datetime import datetime
from pathlib import Path

from project.launch import environment

# Run dirs this process made, so that a failed start removes only what it created itself.
CREATED: set[str] = set()


def unique_dir(path: str) -> str:
    """Claim `path`, or `path_1`, `path_2`, ... if taken: two runs started in the same second get two dirs.

    mkdir is atomic, so concurrent processes cannot claim the same name. Hydra caches the result per process.
    """
    candidate, n = path, 0
    while True:
        try:
            os.makedirs(candidate, exist_ok=False)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}_{n}"


def run_dir(parent: str) -> str:
    """`parent/<start time>` (made unique), or, for ranks started by torchrun or srun, a name they share."""
    name = environment.shared_run_name()
    if name is None:
        path = unique_dir(os.path.join(parent, datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
        CREATED.add(os.path.abspath(path))
        return path
    path = os.path.join(parent, name)
    os.makedirs(path, exist_ok=True)
    return path


def remove_if_unused(run_dir: Path) -> None:
    """Remove the run dir of a run that failed before doing anything, if this process made it (not a dir the
    user named, not a shared torchrun/srun dir, not a sweep job's dir) and it holds only Hydra's bookkeeping."""
    if str(run_dir.resolve()) not in CREATED or not run_dir.is_dir():
        return
    for path in run_dir.rglob("*"):
        if path.is_file() and ".hydra" not in path.relative_to(run_dir).parts and path.suffix != ".log":
            return
    shutil.rmtree(run_dir, ignore_errors=True)
