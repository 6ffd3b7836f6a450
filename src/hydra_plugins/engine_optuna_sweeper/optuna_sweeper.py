"""A Hydra 1.3 sweeper on Optuna 4/5: ask trials, let any Hydra launcher run them, tell the results.
hydra-optuna-sweeper 1.3.0 pins optuna<3 (whose sqlite storage fails under SQLAlchemy 2), counts n_trials per
invocation, stops at the first failed trial and leaves killed trials RUNNING. One sweep per study at a time.
"""

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from engine.errors import UserError, disk_error_in
from engine.loggers import tracking
from engine.sweeps import objective

from . import in_flight, keys, outcome, space, study
from .config import STORAGE_ENV, STUDY_ENV, STUDY_FILE, TRIAL_ID_ENV, TRIAL_NUMBER_ENV
from .errors import SweeperConfigError

log = logging.getLogger(__name__)

# The study of the running sweep, for jobs run in this process when there is no storage (basic launcher).
ACTIVE_STUDY: Any = None


class ProjectOptunaSweeper(Sweeper):
    """See config.ProjectOptunaSweeperConf for the keys."""

    def __init__(
        self,
        direction: str,
        storage: Optional[str],
        study_name: Optional[str],
        n_trials: int,
        n_jobs: int,
        sampler: Any,
        pruner: Any,
        max_failures: Optional[int],
        params: Optional[DictConfig],
    ) -> None:
        direction = {"max": "maximize", "min": "minimize"}.get(direction, direction)  # monitor.mode's words
        if direction not in ("maximize", "minimize"):
            raise SweeperConfigError(f"hydra.sweeper.direction={direction}: use maximize or minimize (or max, min)")
        for key, value in (("n_trials", n_trials), ("n_jobs", n_jobs)):
            if not isinstance(value, int) or value < 1:
                raise SweeperConfigError(f"hydra.sweeper.{key}={value}: must be an integer of at least 1")
        self.direction, self.storage, self.study_name = direction, storage, study_name
        self.n_trials, self.n_jobs, self.max_failures = n_trials, n_jobs, max_failures
        self.sampler_cfg, self.pruner_cfg = sampler, pruner
        self.params: dict[str, Any] = dict(params or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config  # validate_batch_is_legal reads these two
        self._context, self._config = hydra_context, config
        self._launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self._check_direction(config)
        self._check_pruning_reaches_the_study()
        if self.n_jobs > 1 and in_flight.in_this_process(self._launcher):
            raise SweeperConfigError(  # it ran them one after the other, silently
                f"hydra.sweeper.n_jobs={self.n_jobs}: the basic launcher runs one trial at a time; to run "
                f"{self.n_jobs} at once use hydra/launcher=parallel hydra.launcher.n_jobs={self.n_jobs}, or set "
                "hydra.sweeper.n_jobs=1"
            )
        workers = OmegaConf.select(config, "hydra.launcher.n_jobs")
        if in_flight.concurrent(self._launcher) and isinstance(workers, int) and 0 < workers < self.n_jobs:
            raise SweeperConfigError(  # the extra trials would wait in the launcher's queue, counted as running
                f"hydra.sweeper.n_jobs={self.n_jobs}: more trials at once than the launcher's {workers} workers; "
                f"use hydra.sweeper.n_jobs={workers}, or raise hydra.launcher.n_jobs"
            )

    def _check_direction(self, config: DictConfig) -> None:
        """The trials return a form of monitor.metric (engine.sweeps.objective), which the pruner judges each epoch:
        a direction against monitor.mode would make the worst trial the best, silently."""
        refused = objective.refusal(config)
        if refused is not None:
            raise SweeperConfigError(str(refused))
        mode = OmegaConf.select(config, "monitor.mode", default=None)
        if mode not in ("max", "min"):
            return
        wanted = {"max": "maximize", "min": "minimize"}[mode]
        if self.direction != wanted:
            metric = OmegaConf.select(config, "monitor.metric", default="monitor.metric")
            raise SweeperConfigError(
                f"hydra.sweeper.direction={self.direction}, but monitor.mode={mode}: the trials return {metric} "
                f"({'higher' if mode == 'max' else 'lower'} is better), so the best trial would be the worst; "
                f"use hydra.sweeper.direction={wanted} (to {self.direction} another metric, set monitor.metric and "
                "monitor.mode)"
            )

    def _check_pruning_reaches_the_study(self) -> None:
        """A study kept in memory lives in this process: jobs that a launcher runs in other processes (parallel's
        workers, SLURM jobs) cannot report to it, so its pruner would never stop a trial."""
        if self.storage or not self.pruner_cfg or in_flight.in_this_process(self._launcher):
            return
        launcher = OmegaConf.select(self._config, "hydra.runtime.choices.hydra/launcher", default=None)
        raise SweeperConfigError(
            f"hydra.sweeper.storage=null keeps the study in this process, which the jobs of "
            f"hydra/launcher={launcher or type(self._launcher).__name__} run outside: no trial would be pruned; "
            "set hydra.sweeper.storage=sqlite:///<path>.db (or hydra.sweeper.pruner=null)"
        )

    def _check_keys(self, parsed: list[Any], n_params: int, search: dict[str, Any], fixed: list[str]) -> None:
        """Every searched key against the trials' composed config, before the sweep dir or the study exists
        (keys.py): a key it lacks, or floats for an int, failed each trial on its own, after the study was made."""
        searched, origin = {}, {}
        for i, override in enumerate(parsed):  # the override that won each searched key (split's order)
            key = override.get_key_element()
            if key in search and override.is_sweep_override():
                searched[key], origin[key] = override, i < n_params
        choice = OmegaConf.select(self._config, "hydra.runtime.choices.hparams_search", default=None)
        params = f"hparams_search={choice}" if choice else "the sweeper's config"

        def where(key: str) -> str:
            return f" (hydra.sweeper.params of {params})" if origin.get(key) else ""

        loader = self._context.config_loader
        keys.check(
            searched,
            search,
            fixed,
            where,
            lambda group: loader.get_group_options(group),
            lambda overrides: self._config if not overrides else loader.load_sweep_config(self._config, overrides),
        )

    def _name(self, search: dict[str, Any], fixed: list[str]) -> str:
        """The configured study name, or one derived from the search (named after the hparams_search option)."""
        if self.study_name:
            return self.study_name
        base = OmegaConf.select(self._config, "hydra.runtime.choices.hparams_search") or self._config.hydra.job.name
        return space.study_name(
            str(base).replace("/", "_"), search, fixed, self.direction, objective.metric(self._config)
        )

    def _job_overrides(self, trial: Any, search: dict[str, Any], fixed: list[str], name: str) -> list[str]:
        chosen = [f"{key}={space.suggest(trial, key, dist)}" for key, dist in search.items()]
        env = {TRIAL_ID_ENV: trial._trial_id, TRIAL_NUMBER_ENV: trial.number, STUDY_ENV: name}
        if self.storage:
            env[STORAGE_ENV] = self.storage
        return chosen + fixed + [f"++hydra.job.env_set.{k}={space.quoted(v)}" for k, v in env.items()]

    def sweep(self, arguments: list[str]) -> None:
        parser = OverridesParser.create(config_loader=self._context.config_loader)
        from_params = [f"{k}={v}" for k, v in self.params.items()]
        parsed = parser.parse_overrides(from_params + arguments)
        search, fixed = space.split(parsed)
        self._check_keys(parsed, len(from_params), search, fixed)
        name = self._name(search, fixed)
        the_study = self._start(name)
        try:
            if self.n_jobs > 1 and in_flight.concurrent(self._launcher):
                self._run_one_by_one(the_study, search, fixed, name)
            else:
                self._run_in_batches(the_study, search, fixed, name)
            study.save_best(the_study, Path(self._config.hydra.sweep.dir) / "optimization_results.yaml")
        except Exception as e:  # the lock goes when the process ends; the jobs' dirs stay
            said = ", so the sweep stopped; make room there, then run the same command again: the study goes on"
            refused = e if isinstance(e, UserError) else self._refusal(e, f"{said} from where it stopped")
            if refused is e:
                raise
            raise refused from e

    def _refusal(self, error: Exception, then: str) -> Exception:
        """A storage's failure, or a full disk under the sweep's files, as one line; any other error as it is."""
        reason = study.storage_failure(error)
        if reason is not None:
            return SweeperConfigError(f"hydra.sweeper.storage={self.storage}: cannot be written ({reason}){then}")
        return disk_error_in(error) or error

    def _start(self, name: str) -> Any:
        """The study, locked and opened, and the sweep dir's files that name it. Refused (an unusable storage, a full
        disk), it leaves nothing behind: no lock, no database or folders it created, no files."""
        global ACTIVE_STUDY
        path = tracking.sqlite_file(self.storage)
        folders = [p for p in (path.parent, *path.parent.parents) if not p.exists()] if path else []
        new_database = path is not None and not path.exists()
        sweep_dir = Path(self._config.hydra.sweep.dir)
        written = [p for p in (sweep_dir / "multirun.yaml", sweep_dir / STUDY_FILE) if not p.exists()]
        self._lock = study.lock(name, self.storage)  # held while this process lives
        try:
            the_study = ACTIVE_STUDY = study.open_study(
                name, self.storage, self.direction, objective.metric(self._config), self.sampler_cfg, self.pruner_cfg
            )
            # written once the storage has passed: a refused sweep leaves no sweep dir (engine.entry removes it)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(self._config, sweep_dir / "multirun.yaml")
            study.save_name(sweep_dir / STUDY_FILE, name, self.storage, self.direction)
            study.retry_interrupted(the_study)
            log.info(
                f"Study {name} ({self.storage or 'in memory'}), direction {self.direction}: "
                f"{study.finished(the_study)} of {self.n_trials} trials done"
            )
        except BaseException as e:
            ACTIVE_STUDY = None
            study.release(self._lock)
            if new_database and path is not None:
                tracking.remove_sqlite(path)
                for folder in folders:  # the deepest first
                    with contextlib.suppress(OSError):
                        folder.rmdir()
            for each in written:
                with contextlib.suppress(OSError):
                    each.unlink()
            if not isinstance(e, Exception) or isinstance(e, UserError):  # Ctrl-C, or said already (open_study)
                raise
            refused = self._refusal(e, "; make room there, or use a storage on a writable disk")
            if refused is e:
                raise
            raise refused from e
        return the_study

    def _too_many_failures(self, failures: int) -> bool:
        if self.max_failures is None or failures < self.max_failures:
            return False
        log.error(f"{failures} trials failed in this run (max_failures={self.max_failures}): no new trials")
        return True

    def _record(self, the_study: Any, trial: Any, ret: JobReturn, job_dir: Optional[Path] = None) -> bool:
        """Tell the study how the trial's job ended; True when it failed."""
        if job_dir is None and ret.hydra_cfg is not None:
            job_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir)
        if job_dir is not None:
            trial.set_user_attr("output_dir", str(job_dir))
        return outcome.record(the_study, trial, ret, job_dir) == "FAIL"

    def _run_in_batches(self, the_study: Any, search: dict[str, Any], fixed: list[str], name: str) -> None:
        """n_jobs trials handed to the launcher at once, the next batch when all of them are done: the basic
        launcher runs them one after the other in this process."""
        failures = 0
        while (to_go := self.n_trials - study.finished(the_study)) > 0 and not self._too_many_failures(failures):
            trials = [the_study.ask() for _ in range(min(self.n_jobs, to_go))]
            try:
                batch = [self._job_overrides(trial, search, fixed, name) for trial in trials]
                self.validate_batch_is_legal(batch)
                returns = self._launcher.launch(batch, initial_job_idx=trials[0].number)
            except BaseException:  # a bad override, Ctrl-C: these trials did not run, or not to their end
                for trial in trials:
                    study.abandon(the_study, trial._trial_id, trial.params)
                raise
            for trial, ret in zip(trials, returns):
                failures += self._record(the_study, trial, ret)
            if study.stopped(the_study):
                log.info("The sampler has tried every point of the search space: done")
                break

    def _run_one_by_one(self, the_study: Any, search: dict[str, Any], fixed: list[str], name: str) -> None:
        """n_jobs trials in flight: whenever one ends, the next is asked for and launched at once (in_flight.py)."""
        log.info(f"{self.n_jobs} trials at a time: the next one starts as soon as any of them ends")
        running = in_flight.InFlight(self._launcher)
        failures, asking = 0, True
        try:
            while True:
                while asking and len(running) < self.n_jobs:
                    if self.n_trials - study.finished(the_study) - len(running) <= 0:
                        break
                    if self._too_many_failures(failures):
                        asking = False
                        break
                    trial = the_study.ask()
                    try:
                        overrides = self._job_overrides(trial, search, fixed, name)
                        self.validate_batch_is_legal([overrides])
                    except BaseException:
                        study.abandon(the_study, trial._trial_id, trial.params)
                        raise
                    running.start(trial, overrides)
                if not running:
                    break
                trial, overrides, result = running.next_done()
                if isinstance(result, BaseException):  # the launcher lost the job: failed, the others go on
                    failures += self._record(
                        the_study, trial, self._lost(result, overrides), self._job_dir(overrides, trial.number)
                    )
                else:
                    failures += self._record(the_study, trial, result)
                if asking and study.stopped(the_study):
                    log.info("The sampler has tried every point of the search space: done once the running trials end")
                    asking = False
        except BaseException as e:  # a bad override, Ctrl-C: the trials still running did not run to their end
            cut = [trial.number for trial in running.trials()]
            for trial in running.trials():
                study.abandon(the_study, trial._trial_id, trial.params)
            if not isinstance(e, KeyboardInterrupt):
                raise
            # Ctrl-C reached the workers too (one process group): their jobs stop as a single run's would
            print(
                f"stopped by SIGINT: trials {cut} were cut off; the same command runs them again first", file=sys.stderr
            )
            raise SystemExit(130) from None

    @staticmethod
    def _lost(error: BaseException, overrides: list[str]) -> JobReturn:
        """A failed JobReturn for a job the launcher raised on instead of returning it (a killed worker process)."""
        lost = in_flight.LostJob(
            "its worker process died, or was stopped with the pool when another worker died: "
            f"{type(error).__name__}: {' '.join(str(error).split())}"
        )
        lost.__cause__ = error
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=lost)

    def _job_dir(self, overrides: list[str], number: int) -> Path:
        """The directory the launcher gave this job, named as Hydra's run_job names it (hydra.sweep.subdir)."""
        cfg = self._context.config_loader.load_sweep_config(self._config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.num = number
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
