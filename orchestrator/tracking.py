"""MLflow tracking of a run: params, metrics, artifacts and tags.

Metrics go through ``MlflowClient.log_batch(..., synchronous=False)``: MLflow queues them on
its own background thread, so a slow tracking server (~0.1 s per call here) never stalls the
training loop; :meth:`RunTracker.finish` waits for the queued batches before ending the run.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from plans.errors import OrchError

# MLflow accepts at most this many params in one log_batch call.
_PARAMS_PER_BATCH = 100


def redact_uri(uri: str) -> str:
    """Drop any user:password from a URI before it is printed or recorded."""
    parts = urlsplit(uri)
    if parts.password is None and parts.username is None:
        return uri
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def flatten(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"plan": {"dp": 2}}`` → ``{"plan.dp": "2"}``; lists are kept as JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value))
        else:
            flat[name] = str(value)
    return flat


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class TrackingError(OrchError):
    """The tracking backend cannot be used."""


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a fix, when a tracking server does not answer.

    MLflow's own client retries an unreachable server with backoff for minutes before it
    gives up; a user who mistyped tracking.uri should know at once, before any worker starts.
    """
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # the server answered (a proxy in front may not route /health): reachable
    except OSError as exc:
        raise TrackingError(
            f"tracking.uri={redact_uri(uri)}: no MLflow server answers there ({exc}). Fix: start the "
            "server, correct tracking.uri, or set tracking.fallback=local to track in ./mlflow.db") from exc


class RunTracker:
    """One MLflow run. Create with :meth:`start`; always :meth:`finish` it."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str, uri: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.uri = uri
        self._pending = []  # RunOperations of queued metric batches

    @classmethod
    def start(cls, *, uri: str, experiment: str, run_name: str | None, params: Mapping[str, str],
              tags: Mapping[str, str]) -> RunTracker:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
        tracker = cls(client, run.info.run_id, experiment_id, uri)
        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            client.log_batch(tracker.run_id, params=items[i:i + _PARAMS_PER_BATCH])
        return tracker

    @classmethod
    def resume(cls, *, uri: str, run_id: str) -> RunTracker:
        """Continue an existing run (a resumed training): same id, marked RUNNING again."""
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        return cls(client, run_id, run.info.experiment_id, uri)

    @property
    def run_name(self) -> str:
        return self.client.get_run(self.run_id).info.run_name

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue metrics for one step; returns at once."""
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        """Flush queued metrics, then end the run with ``FINISHED``, ``FAILED`` or ``KILLED``."""
        for operation in self._pending:
            operation.wait()
        self._pending.clear()
        self.client.set_terminated(self.run_id, status=status)

    def ui_hint(self) -> str:
        """How a user opens this run."""
        if self.uri.startswith(("http://", "https://")):
            return f"{redact_uri(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return (f"mlflow ui --backend-store-uri {self.uri}  then open "
                f"http://127.0.0.1:5000/#/experiments/{self.experiment_id}/runs/{self.run_id}")
