"""MLflow without a server: runs in a sqlite file under logs/, artifacts in a folder beside it.

Lightning's MLFlowLogger, with what it leaves out here: params are the whole resolved config under dotted keys
(`model.optimizer.lr`) and the config groups chosen (`model=lenet`); the best checkpoint is an artifact at the
end of fit; a resumed run continues its MLflow run (the id is kept in the run dir, engine.loggers.tracking);
each job of a sweep is a child of one parent run of the sweep (engine.sweeps.mlflow_runs). mlflow is imported
only when a run starts (it costs about a second).
"""

import contextlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from engine.errors import UserError
from engine.loggers import tracking
from engine.sweeps import mlflow_runs as mlflow_sweep

log = logging.getLogger(__name__)

NAME = "mlflow"


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model": {"optimizer": {"lr": 0.1}}}` -> `{"model.optimizer.lr": 0.1}`; lists of mappings by index."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            flat.update(_flatten({str(i): v for i, v in enumerate(value)}, f"{name}."))
        else:
            flat[name] = value
    return flat


def _database(tracking_uri: str) -> Path | None:
    """The file of a `sqlite:///<path>` store (4 slashes: an absolute path), else None."""
    return Path(tracking_uri[len("sqlite:///") :]) if tracking_uri.startswith("sqlite:///") else None


def _beside(tracking_uri: str, experiment_name: str) -> str | None:
    """Artifacts of a new experiment in a sqlite store: `mlartifacts/<experiment>/` beside its file (MLflow would
    put them in ./mlruns of whatever directory the run started in); a server keeps its own."""
    database = _database(tracking_uri)
    return str(database.parent.resolve() / "mlartifacts" / experiment_name) if database is not None else None


def _store_lock(tracking_uri: str) -> contextlib.AbstractContextManager[None]:
    """For a sqlite store, a lock beside its file: two processes that open a new file at once would both create
    its tables, and one fails."""
    database = _database(tracking_uri)
    if database is None:
        return contextlib.nullcontext()
    database.parent.mkdir(parents=True, exist_ok=True)
    return tracking.locked(f"{database}.lock")


def _check_server(tracking_uri: str) -> None:
    """A tracking server that does not answer ends the run at once: MLflow's client would retry every request
    for minutes (7 retries with a growing backoff) before it says so."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=10).close()
    except urllib.error.HTTPError:  # it answered: whatever it says to /health, the requests will tell
        return
    except OSError as e:
        reason = getattr(e, "reason", e)
        raise UserError(
            f"logger.mlflow.tracking_uri={tracking_uri}: no server answers there ({reason}); start it (README, "
            "Experiment tracking) or leave tracking_uri to the local store"
        ) from e


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's MLFlowLogger for a local store, continuing the run of a resumed checkpoint.

    `run_dir` keeps the run's id (trackers.json); `resume_from` is the checkpoint a resumed run trains on from,
    whose run dir names the MLflow run to continue when `resume`; `run_id` names one outright.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        run_dir: str,
        artifact_location: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        resume_from: str | None = None,
        resume: bool = True,
        log_best_checkpoint: bool = True,
        tags: dict[str, Any] | None = None,
    ) -> None:
        tracking.require("mlflow", NAME)
        _check_server(tracking_uri)
        self._run_dir = run_dir
        self._continued = tracking.continued(NAME, run_dir, resume_from, resume) if run_id is None else None
        if self._continued is not None:
            run_id = self._continued.get("run_id")
            if self._continued.get("tracking_uri") != tracking_uri:
                raise UserError(
                    f"logger.mlflow: the run resumed here was tracked as MLflow run {run_id} in "
                    f"{self._continued.get('tracking_uri')}, this run logs to {tracking_uri}: set "
                    f"logger.mlflow.tracking_uri to that store to continue it, or logger.mlflow.resume=false for a "
                    "new MLflow run"
                )
        try:
            with _store_lock(tracking_uri):  # the client opens the store: a new sqlite file gets its tables here
                super().__init__(
                    experiment_name=experiment_name,
                    run_name=run_name or tracking.run_name(run_dir),
                    tracking_uri=tracking_uri,
                    tags={"run_dir": str(run_dir), **(tags or {})},
                    artifact_location=artifact_location or _beside(tracking_uri, experiment_name),
                    run_id=run_id,
                )
        except Exception as e:  # a store of another format, a path that is not a database: one line
            raise UserError(f"logger.mlflow: tracking_uri={tracking_uri}: {tracking.one_line(e)}") from e
        self._log_best = log_best_checkpoint
        self._params: dict[str, str] | None = None  # what the run holds already: MLflow params never change
        self._best_callbacks: list[Any] = []
        self._logged_best: dict[str, float] = {}

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The client, once the experiment and run exist: made under a lock (parallel sweep jobs must not both
        create the database's tables, or the sweep's parent run)."""
        if self._initialized:
            return self._mlflow_client
        try:
            with _store_lock(self._tracking_uri):
                sweep_dir = tracking.sweep_dir()
                if self._run_id is None and sweep_dir is not None:
                    self._experiment_id, parent = mlflow_sweep.parent_run(
                        self._mlflow_client, sweep_dir, self._experiment_name, self._artifact_location
                    )
                    self.tags = {**(self.tags or {}), "mlflow.parentRunId": parent}
                client = super().experiment
        except UserError:
            raise
        except Exception as e:  # a store of another format, a run deleted from it: one line
            fix = "; logger.mlflow.resume=false starts a new MLflow run" if self._continued is not None else ""
            raise UserError(f"logger.mlflow: tracking_uri={self._tracking_uri}: {tracking.one_line(e)}{fix}") from e
        if self._continued is not None:
            client.update_run(self._run_id, status="RUNNING")  # it ended (FINISHED, FAILED, KILLED) or was killed
            log.info("Continuing MLflow run %s", self._run_id)
        tracking.remember(
            self._run_dir,
            NAME,
            {"run_id": self._run_id, "experiment_id": self._experiment_id, "tracking_uri": self._tracking_uri},
        )
        return client

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The run config under dotted keys, and (once) the config groups chosen. A key already in the run with
        another value (a resumed run with more epochs, the module's own hyperparameters) keeps its first value
        as the param; the new one is the tag `changed.<key>`."""
        from lightning.fabric.utilities.logger import _convert_params
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

        client = self.experiment
        flat = _flatten(_convert_params(params))
        if self._params is None:  # the first call (train.py: the run config, before fit)
            self._params = dict(client.get_run(self.run_id).data.params)
            flat = {**tracking.chosen_groups(), **flat}  # `model: lenet` beside `model.net._target_: ...`
        new, changed = {}, {}
        for key, value in flat.items():
            key = re.sub(r"[^a-zA-Z0-9_\-. /]", "_", key)[:MAX_ENTITY_KEY_LENGTH]
            text = str(value)[:MAX_PARAM_VAL_LENGTH]
            if key not in self._params:
                new[key] = self._params[key] = text
            elif self._params[key] != text:
                changed[f"changed.{key}"[:MAX_ENTITY_KEY_LENGTH]] = str(value)[:MAX_TAG_VAL_LENGTH]
        items = [Param(k, v) for k, v in new.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params a call
            client.log_batch(self.run_id, params=items[start : start + 100])
        if changed:
            log.info("MLflow run %s keeps its params; %d differ here: tags changed.<key>", self.run_id, len(changed))
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in changed.items()])

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """The checkpoint callbacks that judge by a metric: their best file is logged at the end of fit."""
        if getattr(checkpoint_callback, "monitor", None) and checkpoint_callback not in self._best_callbacks:
            self._best_callbacks.append(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self._initialized and status == "success" and self._log_best:
            self._log_best_checkpoints()
        super().finalize(status)

    def _log_best_checkpoints(self) -> None:
        """Each best checkpoint under `checkpoints/` in the run's artifacts (once per new best), and the tag
        `best_checkpoint` naming it; a resumed run that finds a better one adds it."""
        for callback in self._best_callbacks:
            path = Path(callback.best_model_path) if callback.best_model_path else None
            if path is None or not path.is_file() or self._logged_best.get(str(path)) == path.stat().st_mtime:
                continue
            self.experiment.log_artifact(self.run_id, str(path), "checkpoints")
            self.experiment.set_tag(self.run_id, "best_checkpoint", f"checkpoints/{path.name}")
            self._logged_best[str(path)] = path.stat().st_mtime
