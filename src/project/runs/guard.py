"""A Hydra callback that refuses a run before Hydra writes anything into its directory.

Hydra saves `.hydra/config.yaml` and opens the job's log in the run dir before the task starts, so a
check inside the task comes too late to leave another run's files alone. `on_run_start` and
`on_multirun_start` run before that. Hydra turns a callback's exceptions into warnings, so a refusal
exits here (project.errors.exit_with).
"""

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from project.entry import full_error
from project.errors import UserError, exit_with
from project.launch import environment
from project.runs.dirs import holds_checkpoints


def _refuse(run_dir: Path) -> UserError:
    return UserError(
        f"{run_dir} already holds checkpoints of an earlier run: to continue it pass "
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}; for a new run use a new directory "
        "(with torchrun: a new --rdzv-id)"
    )


def _stop(error: UserError) -> None:
    if full_error():
        raise SystemExit(error)  # PROJECT_FULL_ERROR=1: with the traceback of where it stopped
    exit_with(error)


class RunDirGuard(Callback):
    """A directory with checkpoints belongs to a training run: only a restart of that job writes there again."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Ranks that Lightning or a sweep job started join a directory their parent already checked.
        if config.hydra.output_subdir is None or environment.restarted():
            return
        HydraConfig.instance().set_config(config)
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        if holds_checkpoints(run_dir):
            _stop(_refuse(run_dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if environment.restarted():
            return
        HydraConfig.instance().set_config(config)
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        for job_dir in sorted(sweep_dir.glob("*")):
            if job_dir.is_dir() and holds_checkpoints(job_dir):
                _stop(_refuse(job_dir))
