"""OmegaConf resolvers used by conf/."""

from omegaconf import OmegaConf

from engine.launch.environment import global_rank
from engine.runs.dirs import cwd, run_dir
from engine.runs.guard import sweep_job_dir


def rank_log() -> str:
    """What a log file's name gets for rank r > 0 of torchrun or srun (`_ddp_process_<r>`, as ddp's ranks): each
    rank its own file, not every rank's lines interleaved in the run's."""
    rank = global_rank()
    return f"_ddp_process_{rank}" if rank else ""


def register_resolvers() -> None:
    for name, resolver in (("run_dir", run_dir), ("rank_log", rank_log), ("cwd", cwd)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=True)
    # not cached: the sweep's resolver cache is copied into every job, and each job claims its own directory
    if not OmegaConf.has_resolver("sweep_job_dir"):
        OmegaConf.register_new_resolver("sweep_job_dir", sweep_job_dir, use_cache=False)
