"""OmegaConf resolvers used by conf/."""

import os

from omegaconf import OmegaConf


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


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("unique_dir"):
        OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True)
