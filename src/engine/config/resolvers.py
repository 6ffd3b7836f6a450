"""OmegaConf resolvers used by conf/."""

from omegaconf import OmegaConf

from engine.runs.dirs import cwd, run_dir


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir, use_cache=True)
    if not OmegaConf.has_resolver("cwd"):
        OmegaConf.register_new_resolver("cwd", cwd, use_cache=True)
