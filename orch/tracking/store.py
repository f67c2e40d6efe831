"""MLflow tracking of a run: params, metrics, artifacts and tags, and the checks that the store
can be used at all (a server that answers MLflow's API and accepts the user, a sqlite store that
several runs may create at once), each failing as a user error naming tracking.uri.

Metrics go to a :class:`MetricBuffer` that a background thread sends in batches, so a slow
tracking server (~0.1 s per call here) never stalls the training loop, and a server that goes
away in the middle of a run only delays them: they are sent once it is back, and
:meth:`RunTracker.finish` waits for them before ending the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orch.credentials import (
    PASSWORD_ENV,
    USERNAME_ENV,
    redact_text,
    redact_uri,
    server_credentials,
    use_credentials,
)
from orch.plans.errors import OrchError
from orch.tracking.local_store import sqlite_database, sqlite_store_problem

T = TypeVar("T")

# MLflow accepts at most this many params in one log_batch call.
_PARAMS_PER_BATCH = 100


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


class TrackingUnreachable(TrackingError):
    """No tracking server answers at the URI: the one case tracking.fallback=local replaces it."""


# A read every MLflow server (2.0 and later) serves under its authentication: unlike /health, its
# answer proves that the URI points at MLflow's API and that the credentials are accepted.
_PROBE_ENDPOINT = "/api/2.0/mlflow/experiments/search"
_CREDENTIALS_FIX = f"set {USERNAME_ENV} and {PASSWORD_ENV} to a user of that server"


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a fix, when a tracking server does not answer, is not MLflow, or refuses us.

    MLflow's own client retries an unreachable server with backoff for minutes before it
    gives up, and reports a refused login or a wrong path as a traceback deep in the run's
    start; a user who mistyped tracking.uri should know at once, before any worker starts.
    The request goes through MLflow's own HTTP layer, so it authenticates exactly as MLflow
    will (basic auth from the environment, tokens, TLS settings).
    """
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    uri = without_credentials(uri)
    if not uri.startswith(("http://", "https://")):
        return
    try:
        response = http_request(get_default_host_creds(uri), _PROBE_ENDPOINT, "GET", params={"max_results": 1},
                                max_retries=0, timeout=timeout_s, raise_on_status=False)
    except MlflowException as exc:
        raise TrackingUnreachable(
            f"{_named(uri)}: no MLflow server answers there ({_network_cause(exc.message)}). Fix: start the "
            "server, correct tracking.uri, or set tracking.fallback=local to track in ./mlflow.db") from exc
    _check_probe_status(uri, response.status_code)


def _check_probe_status(uri: str, status: int) -> None:
    """Turn the probe's HTTP status into the user's fix (200: nothing to fix)."""
    user = os.environ.get(USERNAME_ENV)
    if status == 200:
        return
    if status == 401:
        given = f"refused the credentials of user {user!r}" if user else "needs credentials and none were given"
        raise TrackingError(f"{_named(uri)}: the MLflow server {given} (HTTP 401). Fix: {_CREDENTIALS_FIX} "
                            "(MLflow's own variables, rather than user:password@ in the URI, which shell history "
                            "keeps)")
    if status == 403:
        raise TrackingError(f"{_named(uri)}: the MLflow server accepted user {user!r} but lets it read no "
                            f"experiments (HTTP 403). Fix: ask its admin for permission, or {_CREDENTIALS_FIX}")
    if status == 404:
        raise TrackingError(f"{_named(uri)}: the server there has no MLflow tracking API (HTTP 404 for "
                            f"{_PROBE_ENDPOINT}). Fix: point tracking.uri at the root of an MLflow server, "
                            "e.g. http://host:5000 (check the host, port and path)")
    if status >= 500:
        raise TrackingUnreachable(f"{_named(uri)}: the MLflow server fails (HTTP {status}). Fix: check the "
                                  "server's log, or set tracking.fallback=local to track in ./mlflow.db")
    raise TrackingError(f"{_named(uri)}: the server answers HTTP {status} to MLflow's API. Fix: point "
                        "tracking.uri at an MLflow server")


def _named(uri: str) -> str:
    """How an error names the URI: a database URI keeps its password in memory, never in a message."""
    return f"tracking.uri={redact_uri(uri)}"


def _network_cause(message: str) -> str:
    """The reason at the bottom of a requests/urllib3 error chain: `Connection refused`, not 300 chars."""
    reasons = re.findall(r"\[Errno -?\d+\] ([^'\"()]+)", message)
    if reasons:
        return reasons[-1].strip()
    if "timed out" in message.lower():
        return "timed out"
    return redact_text(message.splitlines()[0])[:200]


def without_credentials(uri: str) -> str:
    """A server's ``uri`` without user:password, which go to MLflow's environment variables instead
    (other URIs unchanged).

    `orch` moves them before the config is composed (orch/credentials.py); this catches
    a URI given by other means (the Python API, a test), so no client ever holds one.
    """
    clean, credentials = server_credentials(uri)
    if credentials is not None:
        use_credentials(credentials, "tracking.uri")
    return clean


def open_client(uri: str) -> MlflowClient:
    """An MLflow client for ``uri``; a refused URI (unknown scheme, unusable path) is a TrackingError.

    A new sqlite store is created (its schema migrated) by the first client that opens it, and
    two processes doing that at once break the migration; the creation is serialized by a lock
    on the store's directory (see :func:`_store_creation_lock`).
    """
    uri = without_credentials(uri)
    _bound_http_retries()
    with _store_creation_lock(uri):
        try:
            return MlflowClient(tracking_uri=uri)
        except MlflowException as exc:
            raise TrackingError(f"{_named(uri)}: MLflow cannot track there ({_store_refusal(uri, exc)}). "
                                "Fix: use sqlite:///mlflow.db, a local directory, or http://host:port of an "
                                "MLflow server") from exc


def open_existing(uri: str) -> MlflowClient:
    """A client for commands that only read runs (`orch runs`, `orch report`): the server must
    answer, and a sqlite store must already exist (opening a missing one would create it empty)."""
    uri = without_credentials(uri)
    check_reachable(uri)
    database = sqlite_database(uri)
    if database is not None and not database.exists():
        raise TrackingError(f"{_named(uri)}: there is no MLflow store at {database}. Fix: run the command "
                            "where the runs were tracked, or set tracking.uri to their store")
    return open_client(uri)


def reading(uri: str, what: str, read: Callable[[], T]) -> T:
    """``read()``, with MLflow's failure turned into a TrackingError naming ``what`` was read."""
    try:
        return read()
    except MlflowException as exc:
        raise TrackingError(f"{_named(uri)}: cannot read {what} ({_first_sentence(exc.message)})"
                            ". Fix: check tracking.uri and the name or id given") from exc


RUN_ID_LENGTH = 32
"""Characters of an MLflow run id (hex); `orch runs` shows the first 12."""


def resolve_run_id(uri: str, given: str) -> str:
    """The full id of the one run whose id starts with ``given`` (what `orch runs` shows), in any
    experiment of the store; ``given`` as it is when it is not a shorter hex prefix.

    A prefix that matches no run, or several, is refused (exit 2), the latter listing them.
    """
    if len(given) >= RUN_ID_LENGTH or not re.fullmatch(r"[0-9a-f]+", given):
        return given
    from mlflow.entities import ViewType

    client = open_existing(uri)

    def matching() -> list:
        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        return client.search_runs(experiments, filter_string=f"attributes.run_id LIKE '{given}%'",
                                  run_view_type=ViewType.ALL, max_results=10) if experiments else []

    runs = reading(uri, f"the runs whose id starts with {given!r}", matching)
    if len(runs) == 1:
        return runs[0].info.run_id
    if not runs:
        raise TrackingError(f"run id {given!r}: no run in {_named(uri)} has an id that starts with it. Fix: copy "
                            "the id from `orch runs` run with the same tracking.uri")
    count = f"{len(runs)}" if len(runs) < 10 else "10 or more"
    listed = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in runs[:5])
    raise TrackingError(f"run id {given!r}: the ids of {count} runs start with it: {listed}"
                        f"{', ...' if len(runs) > 5 else ''}. Fix: give more of the id")


def _store_refusal(uri: str, exc: MlflowException) -> str:
    """Why MLflow refused a store URI, in a few words (its own message lists every registry)."""
    if "unsupported URI" in exc.message:
        return f"no MLflow store for the scheme {uri.split(':', 1)[0]!r}"
    return _first_sentence(exc.message)


def _first_sentence(message: str) -> str:
    return redact_text(message.strip().split(". ")[0].splitlines()[0])[:300]


@contextlib.contextmanager
def _store_creation_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock on the directory of a sqlite store while a client opens it.

    The lock is the directory itself (``flock`` on its descriptor), so nothing is left next to
    the database; it is released when the descriptor closes, even if the process dies. Other
    stores (a server, a directory) need no lock: their creation is not a schema migration.
    """
    database = sqlite_database(uri)
    if database is None:
        yield
        return
    directory = database.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)  # as MLflow would; the lock needs it first
    except OSError as exc:
        raise TrackingError(f"{_named(uri)}: cannot create the sqlite store's directory {directory} "
                            f"({exc.strerror}). Fix: choose a writable path") from exc
    # MLflow would retry opening a store it cannot create for about two minutes, then fail.
    if problem := sqlite_store_problem(uri):
        raise TrackingError(f"{_named(uri)}: {problem}. Fix: choose a writable path")
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        raise TrackingError(f"{_named(uri)}: cannot open the sqlite store's directory {directory} "
                            f"({exc.strerror}). Fix: choose a path this user can read and write") from exc
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def experiment_id_for(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created if missing, also when another run creates it at once."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


class MetricBuffer:
    """Metrics queued in memory and sent by a background thread, surviving server outages.

    MLflow's own asynchronous logging drops a batch once its retries are spent, so a tracking
    server restarted in the middle of a run would lose metrics. Here a failed batch stays at
    the head of the queue and is retried until the server answers again; the training loop
    only ever appends.

    The thread sends what has piled up every ``interval_s``, not on every step: each batch is one
    request and, on a SQL store, one commit: a driver committing every step of a 15-steps-a-second
    run used 12% of a core, nearly all of it in sqlite commits (profiled with py-spy), on a 2-core
    machine where the workers needed both cores. A metric reaches the store at most
    ``interval_s`` late.
    """

    def __init__(self, send: Callable[[list[Metric]], None], *, retry_s: float = 2.0, interval_s: float = 1.0,
                 max_batch: int = 1000):
        self._send = send
        self._retry_s = retry_s
        self._interval_s = interval_s
        self._max_batch = max_batch
        self._queue: list[Metric] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.outage_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def put(self, metrics: list[Metric]) -> None:
        with self._lock:
            self._queue.extend(metrics)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _send_head(self) -> bool:
        """Send the oldest batch; False (batch kept) when the server does not take it."""
        with self._lock:
            batch = self._queue[:self._max_batch]
        if not batch:
            return True
        try:
            self._send(batch)
        except Exception as exc:  # any failure of the backend: keep the batch and retry later
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                _warn(f"tracking server unreachable ({type(exc).__name__}); buffering metrics, training goes on")
            return False
        with self._lock:
            del self._queue[:len(batch)]
        if self.outage_since is not None:
            _warn(f"tracking server back after {time.monotonic() - self.outage_since:.0f}s; "
                  "buffered metrics sent")
            self.outage_since = None
        return True

    def _loop(self) -> None:
        _yield_cpu_to_training()
        while not self._stopping.wait(self._interval_s):
            while self.pending() and not self._stopping.is_set():
                if not self._send_head():
                    self._stopping.wait(self._retry_s)

    def close(self, timeout_s: float) -> list[Metric]:
        """Stop the thread, send what is left until ``timeout_s``; return what could not be sent."""
        self._stopping.set()
        self._thread.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            if not self._send_head():
                time.sleep(self._retry_s)
        with self._lock:
            left, self._queue = self._queue, []
        return left


def _yield_cpu_to_training() -> None:
    """Run the calling thread only when a core would otherwise idle (Linux ``SCHED_IDLE``).

    Ray starts its workers at nice 15, so a driver thread at the default priority preempts a
    training rank the moment it wakes, and in a synchronous step every other rank then waits at
    the next collective for that one. Serialising and committing metrics can wait for the gaps
    (ranks waiting on communication); whatever is left is sent by :meth:`MetricBuffer.close`
    from the driver's own thread. Where the policy does not exist, the thread keeps its priority.
    """
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
        except OSError:
            pass


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _bound_http_retries() -> None:
    """Make one MLflow HTTP call give up within seconds rather than minutes.

    :class:`MetricBuffer` retries for as long as it takes, so MLflow's own long backoff would
    only delay noticing an outage. A user's explicit settings win.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


DIGEST_CHARS = 16
"""Hex characters of a data digest kept in MLflow (its dataset digest column holds at most 36)."""


def dataset_entity(description: Mapping[str, object]) -> Dataset:
    """An MLflow dataset from a data source's ``describe()``: a local path or list of paths is a
    ``local`` source (as MLflow's own ``LocalArtifactDatasetSource`` writes it), a Python target a
    ``code`` source."""
    source = description["source"]
    paths = source if isinstance(source, list) else [source]
    is_path = all(isinstance(p, str) and (p.startswith("/") or "://" in p) for p in paths)
    if is_path:
        source_type, source_json = "local", json.dumps({"uri": paths[0]} if len(paths) == 1 else {"uris": paths})
    else:
        source_type, source_json = "code", json.dumps({"tags": {"target": str(source)}})
    profile = {k: v for k, v in description.items() if k not in ("name", "source", "digest")}
    return Dataset(name=str(description.get("name") or "data"), digest=str(description["digest"])[:DIGEST_CHARS],
                   source_type=source_type, source=source_json, profile=json.dumps(profile, default=str))


class RunTracker:
    """One MLflow run. Create with :meth:`start` or :meth:`resume`; always :meth:`finish` it."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str, uri: str):
        _bound_http_retries()
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.uri = uri
        self._metrics = MetricBuffer(lambda batch: client.log_batch(run_id, metrics=batch))
        self._kept_status: str | None = None
        """The status a resumed run keeps whatever the resume does (FINISHED), or None."""

    @classmethod
    def start(cls, *, uri: str, experiment: str, run_name: str | None, params: Mapping[str, str],
              tags: Mapping[str, str]) -> RunTracker:
        uri = without_credentials(uri)
        client = open_client(uri)
        try:
            experiment_id = experiment_id_for(client, experiment)
            run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
        except MlflowException as exc:  # e.g. a server user that may read the experiment but not write it
            reason = "permission denied" if exc.error_code == "PERMISSION_DENIED" else _first_sentence(exc.message)
            raise TrackingError(f"{_named(uri)}: MLflow refused a new run in experiment {experiment!r} "
                                f"({reason}). Fix: set tracking.experiment to one your user "
                                "may write to, or ask the server's admin for EDIT permission on it") from exc
        tracker = cls(client, run.info.run_id, experiment_id, uri)
        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            client.log_batch(tracker.run_id, params=items[i:i + _PARAMS_PER_BATCH])
        return tracker

    @classmethod
    def resume(cls, *, uri: str, run_id: str) -> RunTracker:
        """Continue an existing run (a resumed training): same id, metrics at their steps.

        A FAILED or KILLED run is marked RUNNING again and ends with this attempt's status. A
        FINISHED run keeps its status whatever this attempt does: its metrics continue in it,
        and a resume that fails is recorded in its ``orch.resume.status`` tag instead, so a
        finished training is never rewritten as failed.
        """
        uri = without_credentials(uri)
        client = open_client(uri)
        try:
            run = client.get_run(run_id)
        except MlflowException as exc:
            raise TrackingError(
                f"{_named(uri)}: the checkpoint to resume belongs to MLflow run {run_id}, which this store does "
                f"not have ({_first_sentence(exc.message)}). Fix: set tracking.uri to the store that run was "
                "tracked in, or train.resume=never to start a fresh run") from exc
        tracker = cls(client, run_id, run.info.experiment_id, uri)
        if run.info.status == "FINISHED":
            tracker._kept_status = "FINISHED"
        else:
            client.update_run(run_id, status="RUNNING")
        return tracker

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue metrics for one step; returns at once, whatever the server's state."""
        now = int(time.time() * 1000)
        self._metrics.put([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def _best_effort(self, what: str, call: Callable[[], object]) -> None:
        """Tags and artifacts during training: a tracking outage must not kill the run."""
        try:
            call()
        except Exception as exc:  # the run goes on; the user is told what was not recorded
            _warn(redact_text(f"could not record {what} in MLflow ({type(exc).__name__}: {exc})"))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        batch = [RunTag(k, str(v)) for k, v in tags.items()]
        self._best_effort(f"tags {sorted(tags)}", lambda: self.client.log_batch(self.run_id, tags=batch))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._best_effort(artifact_file, lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """A binary artifact (a profiler's gzipped trace) at ``artifact_file`` in the run."""
        import tempfile

        def log() -> None:
            folder, _, name = artifact_file.rpartition("/")
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / name).write_bytes(data)
                self.client.log_artifact(self.run_id, str(Path(tmp) / name), folder or None)

        self._best_effort(artifact_file, log)

    def log_figure(self, figure, artifact_file: str) -> None:
        self._best_effort(artifact_file, lambda: self.client.log_figure(self.run_id, figure, artifact_file))

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        self._best_effort(artifact_file, lambda: self.client.log_dict(self.run_id, obj, artifact_file))

    def log_dataset(self, description: Mapping[str, object], context: str = "train") -> None:
        """The run's data as an MLflow dataset input (what ``mlflow.log_input`` records), from a data
        source's ``describe()``: its name, source, digest, and size and settings as its profile."""
        entity = dataset_entity(description)
        inputs = [DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)])]
        self._best_effort("dataset input", lambda: self.client.log_inputs(self.run_id, datasets=inputs))

    def finish(self, status: str = "FINISHED", timeout_s: float = 120.0) -> None:
        """Send buffered metrics (waiting up to ``timeout_s`` for the server), then end the run
        as ``FINISHED``, ``FAILED`` or ``KILLED``. Metrics that still cannot be sent are written
        to a local JSON file, so nothing is lost."""
        unsent = self._metrics.close(timeout_s)
        if unsent:
            path = Path(f"mlflow-unsent-{self.run_id}.json")
            path.write_text(json.dumps([{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}
                                        for m in unsent]))
            _warn(f"{len(unsent)} metrics could not reach the tracking server; saved to {path.resolve()}")
        if self._kept_status:
            self.set_tags({"orch.resume.status": status})
        if self._kept_status and status != self._kept_status:
            _warn(f"this resume ended {status}; MLflow run {self.run_id} stays {self._kept_status}, as it was "
                  "before the resume (tag orch.resume.status records the resume's outcome)")
            return
        self._best_effort(f"the run status {status}",
                          lambda: self.client.set_terminated(self.run_id, status=status))

    def ui_hint(self) -> str:
        """How a user opens this run."""
        if self.uri.startswith(("http://", "https://")):
            return f"{redact_uri(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return (f"mlflow ui --backend-store-uri {redact_uri(self.uri)}  then open "
                f"http://127.0.0.1:5000/#/experiments/{self.experiment_id}/runs/{self.run_id}")
