"""Every check of a storage location ends within ``cluster.connect_timeout_s`` and stops at
Ctrl-C: real pyarrow against an S3 endpoint on loopback that accepts connections and never
answers (as a firewall that drops packets, or a host gone half-way), and against ``gs://``
as this machine reaches it (with no network, pyarrow's GCS retries alone ran 15 minutes)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from helpers.config import compose_config
from helpers.orch_command import orch_run
from helpers.processes import worker_env
from orch.cli import storage_checks_bounded
from orch.config import to_typed
from orch.inputs import input_violations
from orch.launchers.storage import location_violation
from orch.plans.errors import PlanError
from orch.plans.storage.locations import open_location, probe_limit
from orch.tune.plan_file import check_plan_file

ORCH = shutil.which("orch", path=os.path.dirname(sys.executable)) or "orch"
# Time a loaded 2-core machine may add to a limit before the answer arrives.
SLACK_S = 8.0


class Silent:
    """A loopback server that accepts every connection and never answers; counts the connections."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = threading.Semaphore(0)
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            self._held.append(conn)
            self._serve(conn)
            self.accepted.release()

    def _serve(self, conn: socket.socket) -> None:
        """What becomes of an accepted connection: held, never answered."""

    def close(self) -> None:
        """Closing the held connections ends pyarrow's requests to it (the S3 finalizer at exit waits for them)."""
        self.server.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def silent_s3(monkeypatch) -> Iterator[Silent]:
    server = Silent()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "orch-test",
           "AWS_SECRET_ACCESS_KEY": "not-a-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.close()


def timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def test_checkpoint_dir_and_data_paths_on_a_silent_store_time_out_naming_field_value_and_fix(silent_s3):
    cfg, _, _ = to_typed(compose_config("cluster.connect_timeout_s=1", "train.checkpoint_every=5",
                                        "train.checkpoint_dir=s3://orch/run", "data=ray",
                                        "data.paths=[s3://orch/rows/]"))
    with storage_checks_bounded(cfg):
        found, seconds = timed(lambda: input_violations(cfg))
    by_field = {v.field: v for v in found}
    assert set(by_field) == {"train.checkpoint_dir", "data.paths"}, found
    assert by_field["train.checkpoint_dir"].value == "s3://orch/run"
    assert by_field["data.paths"].value == ["s3://orch/rows/"]
    for violation in by_field.values():
        assert violation.message.startswith("timed out after 1 s (cluster.connect_timeout_s)"), violation
        assert "raise cluster.connect_timeout_s" in violation.fix and "AWS_ENDPOINT_URL" in violation.fix
    assert seconds < 2 + SLACK_S  # one second each, not pyarrow's retries


def test_tune_out_on_a_silent_store_times_out(silent_s3):
    cfg, _, _ = to_typed(compose_config("cluster.connect_timeout_s=1", "tune.out=s3://orch/plans/tuned.yaml"))
    with storage_checks_bounded(cfg), pytest.raises(PlanError) as info:
        check_plan_file(cfg)
    [violation] = info.value.violations
    assert (violation.field, violation.value) == ("tune.out", "s3://orch/plans/tuned.yaml")
    assert "timed out after 1 s (cluster.connect_timeout_s)" in violation.message


def test_export_of_a_run_whose_checkpoints_are_on_a_silent_store_times_out(silent_s3, sqlite_uri):
    from mlflow import MlflowClient

    from orch.export import export_run

    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("orch")).info.run_id
    client.log_param(run_id, "train.checkpoint_dir", "s3://orch/run")
    with probe_limit(1), pytest.raises(PlanError) as info:
        export_run(sqlite_uri, run_id, to_typed(compose_config())[1])
    [violation] = info.value.violations
    assert (violation.field, violation.value) == ("train.checkpoint_dir", "s3://orch/run")
    assert violation.message.startswith("timed out after 1 s (cluster.connect_timeout_s)"), violation


def test_reads_of_a_stores_checkpoint_records_are_given_up_within_the_limit(silent_s3):
    """A store that passed its first check and then stalls: the pointer, a manifest and a listing
    are each read within cluster.connect_timeout_s, then refused naming the directory and the
    setting (the pointer's read waited minutes, then a raw OSError)."""
    from orch.launchers.checkpoint import _verified, latest

    for read in (lambda: latest("s3://orch/run"), lambda: _verified("s3://orch/run", "step_000000010")):
        start = time.monotonic()
        with probe_limit(1), pytest.raises(PlanError) as info:
            read()
        assert time.monotonic() - start < 1 + SLACK_S
        [violation] = info.value.violations
        assert (violation.field, violation.value) == ("train.checkpoint_dir", "s3://orch/run")
        assert "timed out after 1 s (cluster.connect_timeout_s)" in violation.message, violation


def test_the_stores_own_limits_are_set_so_an_abandoned_check_ends_too():
    """Before the gs:// check below: a GCS filesystem made while that test's abandoned check still
    retries waited for it (about 30 s here)."""
    s3, _ = open_location("s3://orch/run?endpoint_override=127.0.0.1:9&region=us-east-1", 7.5)
    options = s3.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"], options["region"]) == (7.5, 7.5, "us-east-1")
    gcs, path = open_location("gs://orch/run", 7.5)
    assert gcs.__reduce__()[1][0]["retry_time_limit"].total_seconds() == 8 and path == "orch/run"


def test_a_gs_location_is_answered_or_given_up_within_the_limit():
    """With no network GCS would retry for 15 minutes; with one (and no credentials) it refuses."""
    with probe_limit(2):
        problem, seconds = timed(lambda: location_violation("gs://orch-no-such-bucket/run"))
    assert problem is not None and "Fix:" in problem
    assert seconds < 2 + SLACK_S


def connected(pid: int, port: int, timeout_s: float) -> bool:
    """Whether process ``pid`` opens a connection to ``port`` on loopback within ``timeout_s``.

    Asked of the process itself: the server's own count of connections may include one from an
    earlier test's abandoned check in this process, when the new server was given that one's port."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections(kind="tcp")):
                return True
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.1)
    return False


def test_ctrl_c_during_a_check_of_a_silent_store_ends_orch_check_at_once(silent_s3, tmp_path):
    proc = subprocess.Popen([ORCH, "check", "train.checkpoint_every=5", "train.checkpoint_dir=s3://orch/run",
                             "cluster.connect_timeout_s=600"], cwd=tmp_path, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # A terminal's foreground process handles SIGINT; a backgrounded suite's children ignore it.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert connected(proc.pid, silent_s3.port, timeout_s=180), "orch check never reached the store"
        time.sleep(0.5)  # the request is in flight
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "stopped by SIGINT" in stderr and "Traceback" not in stderr and "Segmentation" not in stderr
    assert seconds < SLACK_S


class StallingProxy(Silent):
    """A loopback proxy to a real S3 server that forwards every request until one names
    ``stall_on``, which it holds unanswered: a store that passes the first check and then stalls
    (as a bucket behind a congested link, or a host gone half-way through a run)."""

    def __init__(self, upstream_port: int, stall_on: bytes) -> None:
        self.upstream_port, self.stall_on = upstream_port, stall_on
        self.stalled = threading.Event()
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        self._held.append(upstream)
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if requests and self.stall_on in chunk:
                    self.stalled.set()
                    return  # the request is never forwarded, the connection never answered
                sink.sendall(chunk)
        except OSError:
            return


def test_train_and_export_give_up_a_store_that_stalls_after_its_check(s3_store, tmp_path):
    """The location check passes (the listing is answered), then reading the checkpoint pointer
    stalls: `orch train train.resume=auto` waited minutes and `orch export` ended in a raw
    OSError; both now exit 2 within cluster.connect_timeout_s, naming the directory."""
    import mlflow

    host = s3_store["env"]["AWS_ENDPOINT_URL"]
    proxy = StallingProxy(int(host.rsplit(":", 1)[1]), stall_on=b"latest.json")
    env = {**worker_env(), **s3_store["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    location, uri = "s3://orch/stalls-after-its-check", f"sqlite:///{tmp_path}/mlflow.db"
    try:
        train = orch_run(["train", "train.steps=2", "train.resume=auto", f"train.checkpoint_dir={location}",
                          "cluster.connect_timeout_s=2", f"tracking.uri={uri}"], cwd=tmp_path, env=env, timeout=240)
        assert proxy.stalled.is_set(), train.stderr[-3000:]
        assert train.returncode == 2, train.stderr[-3000:]
        assert f"train.checkpoint_dir='{location}'" in train.stderr and "timed out after 2 s" in train.stderr
        assert "Traceback" not in train.stderr

        client = mlflow.MlflowClient(uri)
        run_id = client.create_run(client.create_experiment("stalls")).info.run_id
        client.log_param(run_id, "train.checkpoint_dir", location)
        proxy.stalled.clear()
        export = orch_run(["export", run_id, f"tracking.uri={uri}", "cluster.connect_timeout_s=2", "--out",
                           str(tmp_path / "model")], cwd=tmp_path, env=env, timeout=240)
        assert proxy.stalled.is_set(), export.stderr[-3000:]
        assert export.returncode == 2, export.stderr[-3000:]
        assert "train.checkpoint_dir" in export.stderr and "timed out after 2 s" in export.stderr
        assert "Traceback" not in export.stderr and "OSError" not in export.stderr
    finally:
        proxy.close()
