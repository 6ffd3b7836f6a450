"""MLflow without a server: runs in a sqlite file under logs/, artifacts beside it (mlflow imported at run start: ~1 s).
A tracker holds a copy of what the run dir has, so a failing one refuses a run only at start; mid-run, writes go
through a thread (Writer), and the first failure is one `warning:` line after which MLflow gets nothing more.
"""

import contextlib
import logging
import posixpath
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from engine.errors import UserError, say
from engine.loggers import tracking
from engine.loggers.background_writes import Writer
from engine.sweeps import mlflow_runs as mlflow_sweep

log = logging.getLogger(__name__)

NAME = "mlflow"
STOP_WAIT_S = 3.0  # at a stop (SIGTERM, an error), how long the writes still queued may take before they are dropped


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


def _beside(tracking_uri: str, experiment_name: str) -> str | None:
    """Artifacts of a new experiment in a sqlite store: `mlartifacts/<experiment>/` beside its file (MLflow would
    put them in ./mlruns of whatever directory the run started in); a server keeps its own."""
    database = tracking.sqlite_file(tracking_uri)
    return str(database.parent.resolve() / "mlartifacts" / experiment_name) if database is not None else None


def _store_lock(tracking_uri: str) -> contextlib.AbstractContextManager[None]:
    """For a sqlite store, a lock beside its file: two processes that open a new file at once would both create
    its tables, and one fails."""
    database = tracking.sqlite_file(tracking_uri)
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
    """Lightning's MLFlowLogger for a local store, continuing a resumed checkpoint's run: `run_dir` keeps the id,
    `resume_from`'s run dir names the run to continue when `resume`; `run_id` names one outright."""

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
        mlflow_sweep.bound_requests()  # before the first request
        # MLflow prints a store's error on stderr (its SQL, its traceback) before raising it, which the run then says
        # in one line; and its notes as it makes a new store's tables
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
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
        database = tracking.sqlite_file(tracking_uri)
        with _store_lock(tracking_uri):  # the client opens the store: a new sqlite file gets its tables here
            new_store = database is not None and not database.exists()
            try:
                super().__init__(
                    experiment_name=experiment_name,
                    run_name=run_name or tracking.run_name(run_dir),
                    tracking_uri=tracking_uri,
                    tags={"run_dir": str(run_dir), **(tags or {})},
                    artifact_location=artifact_location or _beside(tracking_uri, experiment_name),
                    run_id=run_id,
                )
            except Exception as e:  # another format, not a database, a full disk: one line, and no half-made store
                if new_store and database is not None:
                    tracking.remove_sqlite(database)
                raise UserError(
                    f"logger.mlflow: tracking_uri={tracking_uri}: {tracking.one_line(e)}; fix the store or "
                    "give another (logger.mlflow.tracking_uri)"
                ) from e
        self._log_best = log_best_checkpoint
        self._params: dict[str, str] | None = None  # what the run holds already: MLflow params never change
        self._best_callbacks: list[Any] = []
        self._logged_best: dict[str, float] = {}
        self._writer: Writer | None = None
        self._metric_names: dict[str, str] = {}  # a metric's name here -> its name in MLflow
        self._metric_owners: dict[str, str] = {}  # and back: two names here must not become one there

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (ddp_spawn pickles the trainer) gets a writer of its own when it writes."""
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

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
            if self._continued is not None:
                client.update_run(self._run_id, status="RUNNING")  # it ended (FINISHED, FAILED, KILLED) or was killed
                log.info("Continuing MLflow run %s", self._run_id)
        except UserError:
            raise
        except Exception as e:  # a store of another format, a run deleted from it, no answer: one line
            raise UserError(self._refused(e)) from e
        tracking.remember(
            self._run_dir,
            NAME,
            {"run_id": self._run_id, "experiment_id": self._experiment_id, "tracking_uri": self._tracking_uri},
        )
        return client

    def _refused(self, error: BaseException) -> str:
        """The line that ends a run whose store or server fails before it trains."""
        fix = (
            "logger.mlflow.resume=false starts a new MLflow run"
            if self._continued is not None
            else "check that an MLflow server or store is there, or leave tracking_uri to the local store"
        )
        return f"logger.mlflow: tracking_uri={self._tracking_uri}: {tracking.one_line(error)}; {fix}"

    @property
    def writes(self) -> Writer:
        """Where this run's writes go once it trains: see the module docstring."""
        if self._writer is None:
            self._writer = Writer(self._writes_failed)
        return self._writer

    def _writes_failed(self, error: BaseException, what: str) -> None:
        """Said once, from the writer's thread, when MLflow stops taking this run's writes."""
        say(
            f"warning: logger.mlflow: {what} failed ({tracking.one_line(error, 200)}); the run goes on without "
            f"MLflow (its run {self._run_id} keeps what it got before), and its own files hold every result"
        )

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The run config under dotted keys and (once) the groups chosen; a changed value becomes tag `changed.<key>`.
        The first call is made at once, so a store that cannot take it refuses the run; later ones go to the writer."""
        from lightning.fabric.utilities.logger import _convert_params
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

        client, run_id = self.experiment, self.run_id
        flat = _flatten(_convert_params(params))
        first = self._params is None
        if self._params is None:  # the first call (train.py: the run config, before fit)
            try:
                self._params = dict(client.get_run(run_id).data.params)
            except Exception as e:
                raise UserError(self._refused(e)) from e
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
        tags = [RunTag(k, v) for k, v in changed.items()]
        if changed:
            log.info("MLflow run %s keeps its params; %d differ here: tags changed.<key>", run_id, len(changed))

        def write() -> None:
            for start in range(0, len(items), 100):  # MLflow takes at most 100 params a call
                client.log_batch(run_id, params=items[start : start + 100])
            if tags:
                client.log_batch(run_id, tags=tags)

        if not first:
            self.writes.put("logging the params", write)
            return
        try:
            write()
        except Exception as e:
            raise UserError(self._refused(e)) from e

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Queued for the writer, under the names MLflow gives them (checked: see `_metric_name`), with the time
        they were logged."""
        from mlflow.entities import Metric

        if self.writes.error is not None:  # MLflow took no more of this run's writes: said once, dropped
            return
        timestamp = int(time.time() * 1000)
        batch = [
            Metric(key=self._metric_name(key), value=value, timestamp=timestamp, step=step or 0)
            for key, value in metrics.items()
            if not isinstance(value, str)  # Lightning's MLFlowLogger drops them too
        ]
        client, run_id = self.experiment, self.run_id
        self.writes.put(f"logging the metrics of step {step or 0}", lambda: client.log_batch(run_id, metrics=batch))

    def _metric_name(self, name: str) -> str:
        """`name` as MLflow stores it (Lightning's MLFlowLogger drops every character other than letters, digits and
        `_/. -`); one MLflow refuses, or that two names here would share, ends the run at its first log."""
        known = self._metric_names.get(name)
        if known is not None:
            return known
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH

        stored = re.sub(r"[^a-zA-Z0-9_/. -]+", "", name)
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        if len(stored) > MAX_ENTITY_KEY_LENGTH:
            raise UserError(
                f"logger=mlflow: the metric {shown} has a name of {len(stored)} characters in MLflow, which takes "
                f"at most {MAX_ENTITY_KEY_LENGTH}: log it under a shorter name"
            )
        normal = posixpath.normpath(stored)
        if not stored or normal != stored or normal == "." or normal.startswith(("..", "/")):  # as MLflow checks
            raise UserError(
                f"logger=mlflow: the metric {shown} would be {stored!r} in MLflow, which refuses it (a name there "
                "is a path: no empty part, no leading /, no . or .. part): log it under another name"
            )
        other = self._metric_owners.get(stored)
        if other is not None and other != name:
            raise UserError(
                f"logger=mlflow: the metrics {other!r} and {shown} would both be {stored!r} in MLflow (it keeps "
                "only letters, digits and _ / . - and spaces in a name): log one of them under another name"
            )
        if stored != name:
            log.info("MLflow: the metric %r is logged as %r (characters MLflow does not take left out)", name, stored)
        self._metric_names[name], self._metric_owners[stored] = stored, name
        return stored

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """The checkpoint callbacks that judge by a metric: their best file is logged at the end of fit."""
        if getattr(checkpoint_callback, "monitor", None) and checkpoint_callback not in self._best_callbacks:
            self._best_callbacks.append(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """At each stage's end or a stop: best checkpoints (after a fit), the run's status, and a wait for queued
        writes (STOP_WAIT_S at most after a stop or an error, never past a signal)."""
        if not self._initialized:
            return
        client, run_id = self._mlflow_client, str(self._run_id)
        if status == "success" and self._log_best:
            best = [Path(c.best_model_path) for c in self._best_callbacks if c.best_model_path]
            self.writes.put("logging the best checkpoint", lambda: self._log_best_checkpoints(best))
        state = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}.get(status, status)
        self.writes.put("ending the run", lambda: client.set_terminated(run_id, state))
        self.writes.wait(None if status == "success" else STOP_WAIT_S)

    def _log_best_checkpoints(self, paths: list[Path]) -> None:
        """In the writer's thread: each new best checkpoint as an artifact (in `_folder_for`'s folder), and the tag
        `best_checkpoint` naming it."""
        client, run_id = self._mlflow_client, str(self._run_id)
        for path in paths:
            if not path.is_file() or self._logged_best.get(str(path)) == path.stat().st_mtime:
                continue
            folder = self._folder_for(path.name)
            client.log_artifact(run_id, str(path), folder)
            client.set_tag(run_id, "best_checkpoint", f"{folder}/{path.name}")
            self._logged_best[str(path)] = path.stat().st_mtime

    def _folder_for(self, name: str) -> str:
        """`checkpoints`, or `checkpoints/<run dir name>` (then `-2`, `-3`, ...) when the MLflow run holds `name` there
        already (a run resumed twice from one checkpoint): no artifact is ever written over."""
        own = f"checkpoints/{Path(self._run_dir).name}"
        for folder in ("checkpoints", own, *(f"{own}-{n}" for n in range(2, 1000))):
            if name not in {Path(f.path).name for f in self._mlflow_client.list_artifacts(str(self._run_id), folder)}:
                return folder
        raise RuntimeError(f"{name}: 1000 checkpoints of that name in MLflow run {self._run_id}")
