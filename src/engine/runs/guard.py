"""A Hydra callback that refuses a run before Hydra writes `.hydra/config.yaml` and the job's log into its directory,
which a check inside the task would be too late for. Hydra turns a callback's exceptions into warnings, so a refusal
exits here (engine.errors.exit_with).
"""

import contextlib
import re
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from engine.console import full_error
from engine.errors import UserError, exit_with, user_error_in
from engine.launch import environment
from engine.runs.dirs import (
    CLAIM,
    CREATED,
    claim,
    claim_sweep_job,
    continuing,
    earlier_files,
    holds_checkpoints,
    launch_identity,
    make_writable,
    remove_if_unused,
)

_TASK_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _stop(error: UserError) -> None:
    if full_error():
        raise SystemExit(error)  # PROJECT_FULL_ERROR=1: with the traceback of where it stopped
    exit_with(error)


def _stop_on(error: Exception) -> None:
    found = user_error_in(error)
    if found is None:
        raise error
    _stop(found)


def _refuse_checkpoints(run_dir: Path, ckpt_path: Any = None) -> UserError:
    if ckpt_path:  # already continuing it: what is wrong is the directory
        return UserError(
            f"{run_dir} already holds checkpoints of an earlier run; a run from ckpt_path={ckpt_path} writes a "
            "directory of its own: leave out hydra.run.dir (or name a new one); the earlier run's files stay as they "
            "are"
        )
    return UserError(
        f"{run_dir} already holds checkpoints of an earlier run: to continue it pass "
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}; for a new run use a new directory "
        "(with torchrun: a new --rdzv-id)"
    )


def _stop_job(error: Exception, hydra: Any) -> None:
    """A sweep job refused its directory: the sweep stops. A sweep dir this process made that holds nothing but
    bookkeeping yet (the first job refused) goes, as a refused run's directory does."""
    if user_error_in(error) is not None:
        with contextlib.suppress(Exception):
            remove_if_unused(Path(str(hydra.sweep.dir)))
    _stop_on(error)


def _enclosing_run(path: Path) -> Path | None:
    """The run directory `path` would sit inside, if any: a run's files are its own, not a parent for more."""
    for parent in path.resolve().parents:
        if (parent / ".hydra" / "config.yaml").is_file() or holds_checkpoints(parent):
            return parent
    return None


def _directory(config: DictConfig, key: str) -> Path:
    """The run or sweep dir, resolved (our run_dir resolver claims it) and made, or one line saying why not."""
    HydraConfig.instance().set_config(config)
    name = str(config.task_name)
    if not _TASK_NAME.fullmatch(name) or name in (".", ".."):
        raise UserError(f"task_name={name!r}: a name (letters, digits, _ . -), it names the logs/<task_name> folder")
    path = Path(str(OmegaConf.select(config, key)))
    inside = _enclosing_run(path)
    if inside is not None:
        raise UserError(f"{key}={path} is inside the directory of another run ({inside}); choose a new directory")
    made: list[Path] = []
    try:
        make_writable(key, path, made)
    finally:
        CREATED.update(str(folder.resolve()) for folder in made)  # a failed start removes them (hydra.run.dir=new)
    return path


def _remove_made_and_empty(folder: Path) -> None:
    """A refused sweep's directory and the folders above it that this process made, while they are empty (a claim
    that failed on a full disk left them)."""
    for path in (folder, *folder.parents):
        if str(path.resolve()) not in CREATED:
            return
        try:
            path.rmdir()
        except OSError:  # not empty, or not there
            return


class RunDirGuard(Callback):
    """A directory with checkpoints belongs to a training run: only a restart of that job writes there again. Each run
    dir, sweep dir and sweep job dir is claimed atomically by one launch, one sweep, one job of that sweep."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Ranks that Lightning or a sweep job started join a directory their parent already checked.
        if config.hydra.output_subdir is None:
            return
        try:
            run_dir = _directory(config, "hydra.run.dir")
            if continuing(run_dir):  # a restart, or the launch that wrote these checkpoints going on
                return
            if holds_checkpoints(run_dir):
                raise _refuse_checkpoints(run_dir, OmegaConf.select(config, "ckpt_path", default=None))
            # a directory the launcher names for all its ranks (torchrun, srun), or that the user names for the
            # nodes started by hand, is shared; any other is this run's own
            launch = launch_identity()
            found = earlier_files(run_dir) if launch is None else []
            if found:
                raise UserError(
                    f"hydra.run.dir={run_dir} already holds an earlier run's files "
                    f"({found[0].relative_to(run_dir)}, ...); name a new directory, or leave hydra.run.dir out for a "
                    "fresh one"
                )
            claim(run_dir, "hydra.run.dir", launch)  # a launch's processes join; another launch is refused
        except Exception as e:  # a UserError, or one raised inside a resolver, which OmegaConf wraps
            _stop_on(e)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if environment.restarted():
            return
        try:
            sweep_dir = _directory(config, "hydra.sweep.dir")
            for job_dir in sorted(sweep_dir.glob("*")):
                if job_dir.is_dir() and holds_checkpoints(job_dir):
                    raise _refuse_checkpoints(job_dir)
            launch = launch_identity()  # a sweep that every process of one launch runs (torchrun, srun) shares it
            # another sweep's claim alone: it started this moment, and claim() says so
            found = [p for p in earlier_files(sweep_dir) if p != sweep_dir / CLAIM] if launch is None else []
            if found:
                raise UserError(
                    f"hydra.sweep.dir={sweep_dir} already holds an earlier sweep's files "
                    f"({found[0].relative_to(sweep_dir)}, ...); name a new directory, or leave hydra.sweep.dir out "
                    "for a fresh one"
                )
            claim(sweep_dir, "hydra.sweep.dir", launch, what="sweep")  # its jobs claim theirs under it
        except Exception as e:
            if user_error_in(e) is not None:
                _remove_made_and_empty(Path(str(config.hydra.sweep.dir)))
            _stop_on(e)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep job's directory is its own: two jobs whose hydra.sweep.subdir names one directory, or a job of
        another sweep there, would overwrite each other's checkpoints and results. The first job to claim it keeps
        it; the other stops the sweep in one line before the engine writes there. Hydra has saved the job's .hydra/
        and opened its log before any callback runs: sweep_job_dir claims it before that, where the job log's name
        is resolved."""
        try:
            claim_sweep_job(config.hydra)
        except Exception as e:
            _stop_job(e, config.hydra)


def sweep_job_dir(path: str) -> str:
    """Resolver `${sweep_job_dir:${hydra.runtime.output_dir}}`: `path`, a sweep job's directory, claimed for this job
    (engine.runs.dirs.claim_sweep_job) when Hydra resolves the job log's name, the first thing Hydra does in the
    directory, before it opens the log and saves .hydra/. A refusal exits here: OmegaConf would wrap an exception,
    and a launcher's worker would lose what it says."""
    if HydraConfig.initialized():
        try:
            claim_sweep_job(HydraConfig.get())
        except Exception as e:
            _stop_job(e, HydraConfig.get())
    return path
