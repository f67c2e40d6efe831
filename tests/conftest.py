"""Shared fixtures: a module-scoped Ray, MLflow stores and servers, a loopback S3 server, the
reference run.

Plain helpers (composing configs, starting Ray, watching processes) are in ``tests/helpers/``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from helpers.config import FAST, compose_config
from helpers.processes import free_port
from helpers.ray_cluster import release_shared_ray, use_shared_ray
from helpers.tracking_server import auth_server


@pytest.fixture(scope="session")
def dp_reference_uri(tmp_path_factory, migrated_store):
    """The tracking store of :func:`dp_reference`, its experiment's artifacts beside it: a session
    fixture runs in pytest's working directory (the repository), where MLflow would put them."""
    from mlflow.tracking import MlflowClient

    store = tmp_path_factory.mktemp("dp-reference")
    shutil.copyfile(migrated_store, store / "mlflow.db")
    uri = f"sqlite:///{store}/mlflow.db"
    MlflowClient(tracking_uri=uri).create_experiment("orch", artifact_location=(store / "mlruns").as_uri())
    return uri


@pytest.fixture(scope="session")
def dp_reference(dp_reference_uri):
    """The data-parallel run other layouts are compared with: dp=2, micro-batch 4, ZeRO-1, ``FAST``.

    Trained once per session, on the tests' shared Ray, and shared: tp, pp and universal-checkpoint
    tests all follow this curve, each to its own justified tolerance. Step 7 runs under the profiler
    (tests/test_step_profile.py), which changes no loss.
    """
    from orch.config import to_typed
    from orch.run.driver import run_training

    use_shared_ray()
    cfg = compose_config(*FAST, f"tracking.uri={dp_reference_uri}", "plan.dp=2", "plan.zero_stage=1",
                         "train.profile_steps=[7]")
    return run_training(*to_typed(cfg))


@pytest.fixture(scope="module")
def s3_store():
    """A real S3-compatible server on loopback (moto in server mode) with an empty bucket, and the
    standard AWS variables that reach it (``env``), as a cluster's nodes would hold them."""
    import secrets
    import shutil
    import subprocess
    import sys
    import time

    import boto3

    port = free_port()
    server = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "orch-test",
           "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16), "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="orch")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        yield {"env": env, "bucket": "orch", "client": client}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def mlflow_auth_server(tmp_path_factory):
    """An `mlflow server` behind MLflow's basic authentication, with one admin user
    (``helpers.tracking_server.ADMIN``): its ``url``, ``password``, ``store`` and the URL
    ``with_password``. One for the session: the cluster tests and the submit tests share it."""
    with auth_server(tmp_path_factory.mktemp("mlflow-auth-server"),
                     tmp_path_factory.mktemp("mlflow-auth-config")) as server:
        yield server


SHARED_RAY = "local_ray"
"""The fixture of the tests' shared embedded Ray."""


@pytest.fixture
def local_ray():
    """The embedded Ray the tests that train in this process share: 2 CPUs like this machine, on
    loopback as `orch` starts it.

    Started by the first test that asks and kept for the next ones (a start and shutdown cost
    about 6 s, once per module before): :func:`pytest_collection_modifyitems` runs a file's tests
    that ask for it one after another, and :func:`_no_shared_ray_unasked` shuts it down before any test
    that did not ask, which may start a Ray of its own in this process or expect none.
    """
    use_shared_ray()
    yield


@pytest.fixture(autouse=True)
def _no_shared_ray_unasked(request):
    if SHARED_RAY not in request.fixturenames:
        release_shared_ray()


@pytest.fixture(autouse=True)
def _tier_in_the_report(request):
    """Each test's tier (``slow`` or ``fast``) as a property in the JUnit report, where
    ``.ci/durations.py`` reads it: both tiers run in one pytest run."""
    request.node.user_properties.append(("tier", "slow" if request.node.get_closest_marker("slow") else "fast"))


LONGEST_FILES = ("test_cluster.py", "test_pipeline_e2e.py", "test_fsdp2_e2e.py", "test_workloads_e2e.py",
                 "test_ray_data.py", "test_train_e2e.py", "test_reliability.py", "test_cli.py", "test_submit.py",
                 "test_tune_e2e.py", "test_tune_space.py", "test_memory_probe.py", "test_pipeline.py",
                 "test_hf_pipeline.py", "test_worker_reuse.py", "test_async_tp.py", "test_check.py")
"""The test files that took longest in CI (``.ci/durations.py`` prints them), longest first.

The README's test command runs the files two at a time (``--dist loadfile``) in the order
:func:`pytest_collection_modifyitems` leaves them (``--no-loadscope-reorder``): these first, then
the other files with training tests, then the rest, so that short files, not a long one, end the
run. An order only: a file missing here runs all the same, later."""


def _file_rank(item) -> tuple[int, int]:
    name = item.path.name
    if name in LONGEST_FILES:
        return 0, LONGEST_FILES.index(name)
    return (1 if item.get_closest_marker("slow") else 2), 0


def pytest_collection_modifyitems(items):
    """Files in :data:`LONGEST_FILES`' order, the others as collected; within a file, the tests on
    the shared Ray first, each group in its collected order, so one Ray serves them all."""
    order: dict = {}
    for index, item in enumerate(items):
        rank = _file_rank(item)
        known = order.get(item.path)
        order[item.path] = (min(known[0], rank), known[1]) if known else (rank, index)
    items.sort(key=lambda item: (order[item.path], SHARED_RAY not in getattr(item, "fixturenames", ())))


def pytest_sessionfinish():
    release_shared_ray()


@pytest.fixture(scope="session")
def migrated_store(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store with its tables created and migrated, made once per session.

    MLflow creates a new store's tables and runs its ~60 schema migrations (alembic) the first time
    the store is opened: about 2.3 s of CPU. Tests that need a store but not its creation copy this
    one; creating a store is still tested where it is the point (``orch train``'s default store in
    test_cli, concurrent first runs in test_tracking). Its default experiment is removed, so each
    copy makes its own at its first open, with an artifact root where it is opened, as a new
    store does.
    """
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-migrated") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM experiments")
    return path


@pytest.fixture
def sqlite_uri(tmp_path, monkeypatch, migrated_store) -> str:
    """A local MLflow store of its own (a copy of :func:`migrated_store`); the test runs in
    tmp_path so artifacts land there too."""
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(migrated_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
