"""The real command line, as a user runs it: `python -m orch train ...`."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers.orch_command import orch_popen, orch_run
from helpers.processes import alive, descendants, is_loopback, listening_sockets, worker_env


def orch(*args: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    return orch_run(args, cwd=cwd, timeout=timeout)


def _assert_all_exit(spawned, within_s: float = 30) -> None:
    """Every process the command started (Ray's, the workers) is gone within ``within_s``."""
    deadline = time.monotonic() + within_s
    while alive(spawned):
        assert time.monotonic() < deadline, f"left behind: {alive(spawned)}"
        time.sleep(1)


def test_bad_plan_is_refused_before_anything_starts(tmp_path):
    done = orch("train", "plan.zero_stage=5", "plan.dp=3", "plan.tp=3", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: the plan has 3 problem(s):" in done.stderr
    assert "plan.zero_stage=5" in done.stderr and "plan.dp=3" in done.stderr and "plan.tp=3" in done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout
    assert not (tmp_path / "mlflow.db").exists(), "no run may be tracked for a refused plan"


def test_bad_values_and_paths_are_refused_together_before_ray_or_mlflow(tmp_path):
    (tmp_path / "ckpt").write_text("a file where the checkpoints would go")
    done = orch("train", "data.path=missing.txt", "train.hang_timeout_s=-1", "train.checkpoint_dir=ckpt",
                "train.checkpoint_every=5", "model.n_layer=0", "plan.dp=3", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    for named in ("data.path='missing.txt'", "train.hang_timeout_s=-1.0", "train.checkpoint_dir='ckpt'", "plan.dp=3"):
        assert named in done.stderr
    assert "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout and not (tmp_path / "mlflow.db").exists()
    # The model is probed once the declared values are valid, while an embedded Ray starts: the
    # model's own refusal exits 2 as well, shows nothing of that Ray and leaves none of it running
    # (Ray's agents included, found by their working directory).
    from helpers.processes import processes_mentioning, processes_working_in

    ray_tmp = tmp_path / "raytmp"
    ray_tmp.mkdir()
    done = orch_run(["train", "model.n_layer=0"], cwd=tmp_path, env={**worker_env(), "RAY_TMPDIR": str(ray_tmp)},
                    timeout=120)
    assert done.returncode == 2 and "model.n_layer=0: orch.workloads.gpt.GPT refused its arguments" in done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout and "Traceback" not in done.stderr
    assert not (tmp_path / "mlflow.db").exists()
    deadline = time.monotonic() + 10  # Ray's processes may take a moment to go once the command exits

    def left() -> set[int]:
        return processes_mentioning(str(ray_tmp)) | processes_working_in(str(tmp_path))

    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == set()


def _malformed_config_dir(root) -> str:
    (root / "conf" / "plan").mkdir(parents=True)
    (root / "conf" / "plan" / "broken.yaml").write_text("defaults:\n  - plan_schema\ndp: [1\ntp: 1\n")
    return str(root / "conf")


@pytest.mark.parametrize(("args", "named"), [
    (["plan.dp=abc"], "full_key: plan.dp"),
    (["no_such_key=1"], "Key 'no_such_key' not in 'RunConfig'"),
    (["plan=no_such_plan"], "Available options in 'plan': ddp, fsdp2, pipeline"),
    (["--config-dir", "{conf}", "plan=broken"], "malformed YAML"),
    (["--config-dir", "/no/such/dir"], "'/no/such/dir' not found"),
])
def test_config_errors_exit_2_with_a_short_message_and_verbose_shows_the_traceback(tmp_path, args, named):
    args = [a.format(conf=_malformed_config_dir(tmp_path)) if "{conf}" in a else a for a in args]
    done = orch("check", *args, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and done.stderr.startswith("error: ")
    assert len(done.stderr.strip().splitlines()) < 5 and "Traceback" not in done.stderr, done.stderr
    verbose = orch("check", "--verbose", *args, cwd=tmp_path, timeout=120)
    assert verbose.returncode == 2 and "Traceback (most recent call last)" in verbose.stderr and named in verbose.stderr


def test_an_internal_error_prints_one_line_and_logs_its_traceback_without_credentials(capsys, monkeypatch):
    from orch import exits

    def crash() -> None:
        raise RuntimeError("could not reach http://alice:s3cret@127.0.0.1:1 in time")

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    assert exits.run_command(crash, "train", verbose=False) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: orch train failed: RuntimeError: could not reach") and len(err.splitlines()) == 2
    log = err.split("traceback in ")[1].split(" (or run")[0]
    text = open(log).read()
    assert "Traceback (most recent call last)" in text and "in crash" in text and "s3cret" not in text
    assert "s3cret" not in err and oct(os.stat(log).st_mode & 0o777) == "0o600"
    assert os.environ["HYDRA_FULL_ERROR"] == "0"  # the user's setting is restored
    assert exits.run_command(crash, "train", verbose=True) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_reader_that_stops_early_ends_orch_quietly_as_sigpipe_would(tmp_path):
    """`orch check | true`: the pipe's reader is gone before anything is written."""
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as stdout:
        with orch_popen(["check"], cwd=tmp_path, stdout=stdout, stderr=subprocess.PIPE, text=True) as proc:
            _, err = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, None, err)
    assert done.returncode == 128 + 13, done.stderr
    assert "BrokenPipe" not in done.stderr and "Traceback" not in done.stderr


def test_a_reader_that_stops_after_a_line_ends_orch_without_hydras_error_line(tmp_path):
    """`orch check --json ... | head -1`: the document (about 140 KB, more than a pipe holds) is
    cut off after its first line; Hydra wrote "Error executing job with overrides" for it."""
    proc = orch_popen(["check", "--json", "model=gpt3_175b", "cluster=a100_8x", "cluster.nodes=128",
                       "plan.precision=bf16", "plan.pp=8", "plan.tp=8"],
                      cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("{")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + 13, err
    assert "Error executing job" not in err and "Traceback" not in err and "BrokenPipe" not in err, err


def test_unknown_command_and_help(tmp_path):
    assert orch("--help", cwd=tmp_path).stdout.startswith("usage: orch <command>")
    done = orch("trian", cwd=tmp_path)
    assert done.returncode == 2 and "unknown command 'trian'" in done.stderr


@pytest.mark.slow
def test_train_with_defaults_tracks_a_local_run(tmp_path):
    # train.sweep_metric judges sweeps only: a plain run that does not log it still succeeds.
    done = orch("train", "train.steps=20", "train.sweep_metric=foo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 20/20" in done.stderr  # plain progress lines when not on a terminal
    assert "done: 20 steps" in done.stdout
    assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in done.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("orch").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].info.run_id in done.stdout
    assert runs[0].data.metrics["loss"] < 5.0
    # Each rank runs as many torch threads as its actor has CPUs (1), though the embedded Ray's
    # idle processes imported torch before they were placed.
    placement = json.loads(Path(client.download_artifacts(runs[0].info.run_id, "plan/placement_realized.json",
                                                          str(tmp_path))).read_text())
    assert [rank["torch_threads"] for rank in placement["ranks"]] == [1, 1]
    # The run can be listed and reported afterwards, with its pictures.
    listed = orch("runs", cwd=tmp_path)
    assert listed.returncode == 0 and runs[0].info.run_id[:12] in listed.stdout and "FINISHED" in listed.stdout
    report = orch("report", runs[0].info.run_id, "--out", "rep", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "throughput" in report.stdout and "MFU" in report.stdout and "restarts   0" in report.stdout
    # Where the wall time went: printed at the end of the run, tracked, and in the report.
    assert "goodput " in done.stdout and "% of " in done.stdout
    assert 0 < runs[0].data.metrics["goodput"] < 1
    assert f"goodput    {100 * runs[0].data.metrics['goodput']:.0f}% of " in report.stdout
    assert {"loss.png", "memory.png", "throughput.png"} <= {p.name for p in (tmp_path / "rep").iterdir()}
    # The run checks its plan's prediction: `orch check`'s predicted step (its total and parts) is
    # tracked, and the report sets the measured step time of the later steps beside it.
    check = json.loads(orch("check", "--json", cwd=tmp_path).stdout)["predicted_step"]
    params = runs[0].data.params
    assert float(params["step_time.predicted.total_s"]) == pytest.approx(check["step_time_s"], rel=1e-5)
    assert {key.split(".")[-1] for key in params if key.startswith("step_time.predicted.")} == {
        "total_s", "speeds", "kind", *(f"{part}_s" for part in check["parts_s"])}
    assert params["step_time.predicted.speeds"] == "declared"
    assert params["step_time.predicted.kind"] == "engine=deepspeed zero_stage=0 offload_optimizer=none"
    history = client.get_metric_history(runs[0].info.run_id, "step_time_s")
    measured = statistics.median(p.value for p in sorted(history, key=lambda p: p.step)[len(history) // 2:])
    line = next(line for line in report.stdout.splitlines() if line.startswith("step time"))
    assert f"measured {measured:.4g} s" in line
    assert f"measured / predicted {measured / float(params['step_time.predicted.total_s']):.2f}" in line
    # Each phase of sampled steps is measured, set beside the parts predicted for it, the worst named.
    metrics = runs[0].data.metrics
    assert all(metrics[f"step_phase/{phase}_s"] > 0 for phase in ("forward", "backward", "optimizer")), metrics
    phases = [line for line in report.stdout.splitlines() if line.startswith("  ")]
    assert phases[0].startswith("  forward and backward measured") and "(compute " in phases[0], phases
    assert phases[1].startswith("  optimizer step       measured") and phases[-1].startswith("  most wrong: ")
    assert "step_time.png" in {p.name for p in (tmp_path / "rep").iterdir()}
    # Its prediction was priced at declared speeds: it cannot correct a cluster profile.
    refused = orch("calibrate", "--from-run", runs[0].info.run_id, cwd=tmp_path)
    assert refused.returncode == 2 and "is not a cluster profile" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_ctrl_c_stops_training_cleanly_on_a_loopback_only_ray(tmp_path):
    """Ctrl-C while the run trains: workers and Ray stopped, the run KILLED, one line, exit 130.
    While it trains, every server of the embedded Ray and of the workers listens on loopback only,
    and Ray's token authentication is on. A scheduler's SIGTERM takes the same handler
    (``orch/signals.py``): it is sent during the workers' set-up below, and during training
    by `orch stop` in test_submit."""
    stop, exit_code = signal.SIGINT, 130
    # A shell running this suite in the background (`.ci/run &`) ignores SIGINT, and its children
    # inherit that: Python would then install no KeyboardInterrupt handler. The child restores
    # the default, as a terminal's foreground process has it.
    proc = subprocess.Popen([sys.executable, "-m", "orch", "train", "train.steps=100000",
                             "train.log_every=5"], cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    seen = ""
    while "step 10/" not in seen:  # training is really under way
        assert time.monotonic() < deadline and proc.poll() is None, seen[-3000:]
        seen += proc.stderr.readline()
    spawned = descendants(proc.pid)  # the embedded Ray's daemons and the worker processes
    assert len(spawned) >= 3, spawned
    listening = listening_sockets({proc.pid, *spawned})
    gcs_ports = [port for _, name, _, port in listening if name == "gcs_server"]
    assert gcs_ports and any("TrainWorker" in name for _, name, _, _ in listening), listening
    assert [s for s in listening if not is_loopback(s[2])] == [], "listening beyond loopback"
    assert _gcs_answers_without_a_token(gcs_ports[0]) == "UNAUTHENTICATED"
    proc.send_signal(stop)
    interrupted = time.monotonic()
    _, rest = proc.communicate(timeout=300)
    print(f"exited {time.monotonic() - interrupted:.1f}s after {stop.name}")
    assert proc.returncode == exit_code, rest[-3000:]
    assert rest.strip().splitlines()[-1] == f"stopped by {stop.name}"
    assert "Traceback" not in rest and "SIGTERM received" not in rest, rest[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "KILLED"
    _assert_all_exit(spawned)


SLOW_TO_BUILD = """
import json
import os
import pathlib
import time

import torch


class Net(torch.nn.Module):
    \"\"\"A model whose workers take long to build it (as one loading big weights does). Once a
    worker, past its process-group setup, begins to build it, it writes which of ``names`` its
    environment holds (as any code a run imports could read them) and marks ``started``.\"\"\"

    def __init__(self, started: str, record: str, names: list):
        super().__init__()
        self.body = torch.nn.Linear(16, 4)
        if torch.distributed.is_initialized():  # a worker, not the driver's check
            pathlib.Path(record).write_text(json.dumps({name: name in os.environ for name in names}))
            pathlib.Path(started).touch()
            time.sleep(120)

    def forward(self, x):
        return self.body(x)
"""


@pytest.mark.slow
def test_sigterm_while_the_workers_set_up_exits_143_and_the_workers_never_saw_the_credentials(tmp_path):
    """The driver then waits in ``ray.get``, whose native wait turns the handler's exception into
    a plain KeyboardInterrupt: the command must still name SIGTERM and exit 143, not 130, and end
    its run KILLED.

    The tracking password and a cloud key stay in the command (which uses the former to track
    the run); its workers, which talk to no tracking server and here to no object store, start
    without them, and with the rest of the environment."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "slow.py").write_text(SLOW_TO_BUILD)
    started, record = tmp_path / "building", tmp_path / "worker-env.json"
    names = ["MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "ORCH_TEST_PLAIN"]
    (tmp_path / "conf" / "model" / "slow.yaml").write_text(
        f"_target_: slow.Net\nstarted: {started}\nrecord: {record}\nnames: {json.dumps(names)}\n")
    env = {**worker_env(), "MLFLOW_TRACKING_PASSWORD": "pw-123", "AWS_SECRET_ACCESS_KEY": "key-456",
           "GITHUB_TOKEN": "tok-789", "ORCH_TEST_PLAIN": "1"}
    proc = orch_popen(["train", "--config-dir", "conf", "model=slow", "data=dataset", "objective=classification",
                       "train.steps=5"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    deadline = time.monotonic() + 300
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    spawned = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=300)
    assert proc.returncode == 143, rest[-3000:]
    assert rest.strip().splitlines()[-1] == "stopped by SIGTERM", rest[-3000:]
    assert "Traceback" not in rest and "SIGTERM received" not in rest, rest[-3000:]
    _assert_all_exit(spawned)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0].info.status == "KILLED"
    assert json.loads(record.read_text()) == {"MLFLOW_TRACKING_PASSWORD": False, "AWS_SECRET_ACCESS_KEY": False,
                                              "GITHUB_TOKEN": False, "ORCH_TEST_PLAIN": True}


def _gcs_answers_without_a_token(port: int) -> str:
    """The status of a GCS call that carries no auth token (OK would mean anyone may call it)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=30)
        except grpc.RpcError as error:
            return error.code().name
        return "OK"


@pytest.mark.parametrize("command, address, extra", [
    ("check", "127.0.0.1:{port}", []),
    ("check", "ray://127.0.0.1:{port}", []),
    ("check", "auto", []),  # a stale record of the last `ray start` names a cluster that is gone
    ("train", "127.0.0.1:{port}", ["cluster.discover=false"]),
])
def test_an_unreachable_cluster_fails_within_connect_timeout(tmp_path, command, address, extra):
    """Ray's own retries would wait ~14 minutes, printing a warning every 5 s."""
    from helpers.processes import dead_port, processes_mentioning

    with dead_port() as port, dead_port() as recorded_port:
        address = address.format(port=port)
        ray_tmp = tmp_path / "raytmp"
        (ray_tmp / "ray").mkdir(parents=True)
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{recorded_port}")
        started = time.monotonic()
        done = orch_run([command, f"cluster.address={address}", "cluster.connect_timeout_s=2", *extra],
                        cwd=tmp_path, env={**worker_env(), "RAY_TMPDIR": str(ray_tmp)}, timeout=300)
        took_s = time.monotonic() - started
    print(f"{command} {address}: exit {done.returncode} after {took_s:.1f}s")
    assert done.returncode == 2, done.stderr[-3000:]
    assert took_s < 60
    assert f"error: cluster.address={address}: no Ray cluster answered" in done.stderr
    assert "cluster.connect_timeout_s=2s" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # no Ray warnings
    assert not (tmp_path / "mlflow.db").exists(), "nothing is tracked for a cluster that is not there"
    assert processes_mentioning(str(tmp_path)) == set()


def test_a_ray_address_whose_port_is_not_a_ray_client_server_fails_within_connect_timeout(tmp_path):
    """A gRPC server that is not Ray's client server (the head's GCS port written after ray://, a
    proxy): Ray's client would retry its ping for ~30 s whatever cluster.connect_timeout_s says."""
    import grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))  # serves no service at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        started = time.monotonic()
        done = orch("train", f"cluster.address=ray://127.0.0.1:{port}", "cluster.connect_timeout_s=3",
                    cwd=tmp_path, timeout=120)
        took_s = time.monotonic() - started
    finally:
        server.stop(grace=None)
    print(f"exit {done.returncode} after {took_s:.1f}s")
    assert done.returncode == 2, done.stderr[-3000:]
    assert took_s < 25
    assert done.stderr.startswith(f"error: cluster.address=ray://127.0.0.1:{port}: a server answered there, but not "
                                  "as Ray's client server does (UNIMPLEMENTED"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # no Ray warnings
    assert not (tmp_path / "mlflow.db").exists()


def test_an_unreachable_tracking_server_is_a_clear_error_before_anything_is_tracked(tmp_path):
    from helpers.processes import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    done = orch("train", f"tracking.uri={uri}", cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert f"tracking.uri={uri}: no MLflow server answers there" in done.stderr
    assert "tracking.fallback=local" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


class _NotFound(http.server.BaseHTTPRequestHandler):
    """A web server that is not MLflow: every path is 404, but under /auth/, which asks for credentials (401)."""

    def do_GET(self):  # noqa: N802 (the name http.server calls)
        self.send_error(401 if self.path.startswith("/auth/") else 404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def not_mlflow():
    """The URL of an HTTP server on loopback that answers 404 to everything."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/mlflow"
    server.shutdown()


@pytest.mark.parametrize("command, uri, message", [
    ("train", "ftp://x", "tracking.uri=ftp://x: MLflow cannot track there (no MLflow store for the scheme 'ftp')"),
    ("runs", "ftp://x", "tracking.uri=ftp://x: MLflow cannot track there"),
    ("train", "NOT_MLFLOW", "has no MLflow tracking API (HTTP 404 for /api/2.0/mlflow/experiments/search)"),
    ("runs", "NOT_MLFLOW", "has no MLflow tracking API (HTTP 404"),
    # The fix names MLflow's variables, never credentials written into the URI.
    ("runs", "NEEDS_AUTH", "needs credentials and none were given (HTTP 401). Fix: set MLFLOW_TRACKING_USERNAME "
                           "and MLFLOW_TRACKING_PASSWORD to a user of that server (MLflow's own variables, rather "
                           "than user:password@ in the URI, which shell history keeps)"),
    ("report", "UNREACHABLE", "no MLflow server answers there (Connection refused)"),
    ("runs", "sqlite:///mlflow.db", "there is no MLflow store at"),
    # Refused at once, before torch is imported: MLflow itself retries a store it cannot create for
    # about two minutes.
    ("train", "sqlite:////proc/orch.db", "tracking.uri='sqlite:////proc/orch.db': cannot create the sqlite store "
                                         "/proc/orch.db: /proc is a directory this user cannot create files in"),
    ("tune", "sqlite:////proc/orch.db", "tracking.uri='sqlite:////proc/orch.db': cannot create the sqlite store"),
])
def test_a_tracking_uri_mlflow_cannot_use_is_a_short_error(command, uri, message, not_mlflow, tmp_path):
    from helpers.processes import free_port

    uri = {"NOT_MLFLOW": not_mlflow, "NEEDS_AUTH": not_mlflow.replace("/mlflow", "/auth"),
           "UNREACHABLE": f"http://127.0.0.1:{free_port()}"}.get(uri, uri)
    args = {"train": ["train", "train.steps=1"], "tune": ["tune", "tune.trials=1"], "runs": ["runs"],
            "report": ["report", "0123abcd"]}[command]
    done = orch(*args, f"tracking.uri={uri}", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert message in done.stderr and "Fix:" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 2, done.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("args, expected", [
    # A symbolic link loop, and a link to nothing, are not "no such file".
    (["data=text", "data.files=[loop.txt]"], "data.files='loop.txt': is a symbolic link loop (loop.txt -> loop.txt"),
    (["train.checkpoint_dir=dangling", "train.checkpoint_every=5"],
     "train.checkpoint_dir='dangling': is a symbolic link to nowhere, which does "
                                        "not exist."),
    # A missing pretrained directory is the field's problem, not the model's _target_'s.
    (["model=hf_causal_lm", "model.config=null", "model.pretrained_path=no-such-dir"],
     "model.pretrained_path='no-such-dir': orch.workloads.hf.hf_causal_lm refused its arguments: ValueError: "
     "model.pretrained_path='no-such-dir' no such file or directory"),
    # A model no plan could hold on this cluster is refused as input (exit 2), not "does not fit" (exit 1).
    (["model=gpt", "model.d_model=1000000"], "GiB in fp32 for the parameters alone, more than the 40.0 GiB of the "
                                             "whole cluster"),
])
def test_check_names_what_is_wrong_and_exits_2(tmp_path, args, expected):
    (tmp_path / "loop.txt").symlink_to("loop.txt")
    (tmp_path / "dangling").symlink_to("nowhere")
    done = orch("check", *args, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert expected in done.stderr, done.stderr


def test_check_json_prints_a_json_error_on_stdout(tmp_path):
    done = orch("check", "--json", "plan.zero_stage=5", cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["exit_code"] == 2 and error["violations"] == [{
        "field": "plan.zero_stage", "value": "5", "message": "ZeRO stages are 0, 1, 2 and 3.",
        "fix": "set plan.zero_stage to 0, 1, 2 or 3"}]
    assert "plan.zero_stage=5: ZeRO stages" in done.stderr  # the message, as without --json
    composing = orch("check", "--json", "plan.bogus=1", cwd=tmp_path, timeout=300)
    assert composing.returncode == 2 and "Key 'bogus' not in 'PlanSpec'" in json.loads(composing.stdout)["error"][
        "message"]


def test_a_failed_sweep_job_is_reported_once(tmp_path):
    done = orch("train", "--multirun", "plan.zero_stage=5,6", "train.steps=2", cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    for stage in (5, 6):
        assert done.stderr.count(f"plan.zero_stage={stage}: ZeRO stages are 0, 1, 2 and 3.") == 1, done.stderr


def test_an_export_from_a_broken_checkpoint_record_is_told_how_to_export(tmp_path):
    """A malformed latest.json: the fix is about exporting, not about resuming a run."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("orch"))
    client.log_param(run.info.run_id, "train.checkpoint_dir", "ckpt")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest.json").write_text("{not json")
    done = orch("export", run.info.run_id, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "latest.json is malformed" in done.stderr and "Fix: export only checkpoints this orchestrator wrote" \
        in done.stderr and "resume" not in done.stderr, done.stderr


@pytest.mark.parametrize(("params", "field", "told"), [
    ({"plan.engine": "megatron"}, "plan.engine", "is the engine run"),
    ({"plan.engine": "deepspeed", "plan.tp": "2"}, "run", "only data-parallel checkpoints are consolidated"),
])
def test_export_asks_the_runs_engine_whether_it_can_consolidate(tmp_path, params, field, told):
    """Before any checkpoint is read: an engine orch does not have, and a DeepSpeed run that is
    not data-parallel (its engine's own refusal, orch.launchers.engines.deepspeed.export)."""
    from orch.export import export_run
    from orch.plans.errors import PlanError

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("orch")).info.run_id
    for name, value in params.items():
        client.log_param(run_id, name, value)
    with pytest.raises(PlanError) as refused:
        export_run(uri, run_id, {})
    [violation] = refused.value.violations
    assert violation.field == field and told in violation.message


def test_sigterm_inside_the_block_runs_cleanup_and_exits_143(capsys):
    """Pure: the handler raises where the main thread is, ``finally`` cleanup runs, a second
    signal during cleanup does not abort it, and the previous handlers come back."""
    import os

    from orch.signals import stopped_by_signals

    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(SystemExit) as ended, stopped_by_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal interrupts this
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's second SIGTERM while cleaning up
            cleaned.append(True)
    assert ended.value.code == 143 and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "stopped by SIGTERM" and "already stopping" in err


def test_hydras_flags_are_handed_to_it_first_each_with_its_value():
    from orch.cli import _flags_and_overrides

    args = ["plan.zero_stage=2", "--config-dir", "mine", "model=mine", "-m", "optim.lr=1e-3,3e-3", "--cfg", "job",
            "--info", "defaults", "--info", "~plan.dp", "--config-name=config"]
    flags, others = _flags_and_overrides(args)
    assert flags == ["--config-dir", "mine", "-m", "--cfg", "job", "--info", "defaults", "--info",
                     "--config-name=config"]
    assert others == ["plan.zero_stage=2", "model=mine", "optim.lr=1e-3,3e-3", "~plan.dp"]
