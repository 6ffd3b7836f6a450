"""OmegaConf resolvers used by conf/."""

import os
from datetime import datetime

from omegaconf import OmegaConf

from project import cluster

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
    name = cluster.shared_run_name()
    if name is None:
        path = unique_dir(os.path.join(parent, datetime.now().strftime("%Y-%m-%d_%H-%M-%S")))
        CREATED.add(os.path.abspath(path))
        return path
    path = os.path.join(parent, name)
    os.makedirs(path, exist_ok=True)
    return path


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir, use_cache=True)
