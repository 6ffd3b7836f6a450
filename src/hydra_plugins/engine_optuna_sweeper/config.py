"""The sweeper's config (`hydra/sweeper=project_optuna`) and the names the sweeper and its jobs share."""

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# A job finds its trial through these variables (hydra.job.env_set): they reach jobs in other processes and processes
# a job starts (a DDP job re-run as a single run gets its own hydra.sweeper config back, not the sweep's).
TRIAL_ID_ENV = "HYDRA_OPTUNA_TRIAL_ID"
TRIAL_NUMBER_ENV = "HYDRA_OPTUNA_TRIAL_NUMBER"
STUDY_ENV = "HYDRA_OPTUNA_STUDY"
STORAGE_ENV = "HYDRA_OPTUNA_STORAGE"
METRIC_ATTR = "metric"  # study user attr: the metric its trials return (a study holds values of one metric)
PRUNER_ATTR = "pruner"  # study user attr: the pruner config, for jobs that load the study from storage
PRUNED_ATTR = "pruned"  # trial user attr a job sets when the pruner stopped it (read back from storage)
ERROR_ATTR = "error"  # trial user attr: the one-line error of a failed trial
INTERRUPTED_ATTR = "interrupted"  # trial user attr: the sweep died during this trial; it does not count
# In the sweep dir: which study the sweep ran (name, storage, direction), for the summary's Optuna plots
# (plots.py) and for a person looking for the study of a sweep.
STUDY_FILE = "optuna_study.yaml"


@dataclass
class ProjectOptunaSweeperConf:
    _target_: str = "hydra_plugins.engine_optuna_sweeper.optuna_sweeper.ProjectOptunaSweeper"
    _recursive_: bool = False  # sampler and pruner stay configs: the sweeper builds them (and reseeds the sampler)
    direction: str = MISSING  # maximize | minimize (or max | min), of the number the task returns: no silent default
    storage: Optional[str] = None  # an Optuna storage URL (sqlite:////abs/path.db); null: in memory, no resume
    study_name: Optional[str] = None  # null: derived from the search, so another search never shares its study
    n_trials: int = 20  # finished trials of the whole study, over all restarts
    n_jobs: int = 1  # trials at once: the launcher's parallelism (parallel: kept in flight; basic: a batch)
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    pruner: Any = None  # e.g. {_target_: optuna.pruners.MedianPruner, n_warmup_steps: 1}; null: never prune
    max_failures: Optional[int] = None  # stop asking for new trials after this many failed in this run
    params: Optional[dict[str, str]] = None  # key: a Hydra sweep expression (or a plain value: fixed)


ConfigStore.instance().store(
    group="hydra/sweeper", name="project_optuna", node=ProjectOptunaSweeperConf, provider="engine_optuna_sweeper"
)
