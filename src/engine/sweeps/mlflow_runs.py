"""A sweep in MLflow: one parent run, each job a child (tag `mlflow.parentRunId`), the summary as its artifacts. The
first job creates the parent, its id kept in the sweep dir under a lock (parallel launchers). Imports no Lightning:
the summary (`python -m engine.sweeps.summary`) calls it too.
"""

import os
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.loggers import tracking

NAME = "mlflow"
SUMMARY_FILES = ("summary.md", "summary.csv", "summary.png")

# MLflow's own defaults held a run whose server died for 8.5 minutes; with these a request fails within 26.5 s
# (unless the environment says otherwise). MLflow reads them at each request: set before the first.
REQUEST_LIMITS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "8",  # seconds to connect, and to wait for an answer
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # no wait before the first retry, 2 s before the second
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false",  # a busy server's Retry-After: 600 would be 10 minutes
}


def bound_requests() -> None:
    """REQUEST_LIMITS for this process and those it starts, where the user set no value of their own."""
    for name, value in REQUEST_LIMITS.items():
        os.environ.setdefault(name, value)


def parent_run(client: Any, sweep_dir: str, experiment_name: str, artifact_location: str | None) -> tuple[str, str]:
    """(experiment id, parent run id) of the sweep in `sweep_dir`, created by the first job that asks."""
    tracking_uri = client.tracking_uri
    with tracking.locked(Path(sweep_dir) / ".trackers.lock"):
        known = tracking.recall(sweep_dir, NAME)
        if known is not None and known.get("tracking_uri") == tracking_uri:
            return str(known["experiment_id"]), str(known["run_id"])
        from mlflow.tracking.context.registry import resolve_tags

        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None or experiment.lifecycle_stage == "deleted":
            experiment_id = client.create_experiment(experiment_name, artifact_location=artifact_location)
        else:
            experiment_id = experiment.experiment_id
        tags = resolve_tags({"mlflow.runName": f"sweep {Path(sweep_dir).name}", "run_dir": str(sweep_dir)})
        run_id = client.create_run(experiment_id, tags=tags).info.run_id
        ids = {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri}
        tracking.remember(sweep_dir, NAME, ids)
        return str(experiment_id), str(run_id)


def log_summary(sweep_dir: Path) -> None:
    """At the end of a sweep (engine.sweeps.summary): its summary files as artifacts of the parent run, which then
    ends. Nothing for a sweep without MLflow, and mlflow is not even imported."""
    parent = tracking.recall(sweep_dir, NAME)
    if parent is None:
        return
    tracking.require("mlflow", NAME)
    bound_requests()
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(parent["tracking_uri"])
        for name in SUMMARY_FILES:
            if (sweep_dir / name).is_file():
                client.log_artifact(parent["run_id"], str(sweep_dir / name))
        client.set_terminated(parent["run_id"], "FINISHED")
    except Exception as e:
        raise UserError(f"MLflow parent run {parent['run_id']} of {sweep_dir}: {tracking.one_line(e)}") from e
