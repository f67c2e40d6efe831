"""Real services on loopback: a two-node Ray cluster from `ray start`, and an `mlflow server`."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bench.tracking_overhead import launch_mlflow_server, stop, wait_healthy
from helpers.orch_command import orch_popen, orch_run
from helpers.processes import RAY_STOP_GRACE_S, free_port, kill_tree, processes_mentioning, worker_env
from helpers.ray_cluster import TEST_PATHS
from helpers.tracking_server import ADMIN

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
FAULTS = str(Path(__file__).parent / "faults")
NODE = ["--num-cpus=1", "--object-store-memory=200000000", "--disable-usage-stats"]


def orch_train(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return orch_run(["train", "train.steps=10", "train.log_every=5", *args], cwd=cwd, env=env, timeout=600)


@pytest.fixture(scope="module")
def two_node_ray(s3_store):
    """A head node and a second node, each with 1 CPU, so a 2-worker plan must span both.

    The cluster keeps its files in a temp dir of its own, and teardown stops exactly the
    processes that mention it: `ray stop` would also kill any other Ray on the machine.

    It requires token authentication, with a token of its own: `ray start --head` turns token
    auth on only when a token already sits in ~/.ray/auth_token (an embedded `ray.init` writes
    one), so without this the cluster's mode would depend on which tests ran before. Clients
    reach it with ``env`` (RAY_AUTH_TOKEN_PATH), which is how a user's machine would hold the token.
    Its nodes, and ``env``, reach an S3-compatible store with the standard AWS variables.
    """
    port, client_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    token = Path(temp_dir, "auth_token")
    token.write_text(secrets.token_hex(32))
    env = {**worker_env(), **s3_store["env"], "RAY_AUTH_TOKEN_PATH": str(token)}
    env["PYTHONPATH"] = os.pathsep.join([*TEST_PATHS, env["PYTHONPATH"]])  # the tests' recording models
    fault = os.path.join(temp_dir, "fail-next-client-session")
    # The head waits 25 s, not 30, for a client session server to answer before giving up on it
    # (twice, for the data and the log stream): the injected fault costs less than at Ray's default.
    # At 15 s, a clean-clone CI run lost all three of the driver's attempts: the injected failure,
    # then two healthy session servers too slow to start while the other xdist worker loaded the machine.
    # The rest is the client's reconnect grace period, which the head waits out before the failed
    # session's stream ends: Ray's default of 30 s, 10 s for the killed-worker test's driver.
    head_env = {**env, "PYTHONPATH": f"{FAULTS}{os.pathsep}{env['PYTHONPATH']}", "ORCH_FAULT_CLIENT_SERVER": fault,
                "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "25", "RAY_AUTH_MODE": "token",
                # A node whose raylet is gone is declared dead after 3 missed health checks a second
                # apart (Ray's default: 5, 3 s apart): the elastic run's re-plan waits for it.
                "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--include-dashboard=false", f"--ray-client-server-port={client_port}",
                        f"--temp-dir={temp_dir}", *NODE], env=head_env, check=True, capture_output=True, timeout=120)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", *NODE], env={**env, "RAY_AUTH_MODE": "token"},
                       check=True, capture_output=True, timeout=120)
        yield {"gcs": f"127.0.0.1:{port}", "client": f"ray://127.0.0.1:{client_port}", "temp_dir": temp_dir,
               "fail_next_client_session": fault, "env": env}
    finally:
        # The client proxy and its session servers name the GCS port, not the temp dir; left
        # running, they would hold the session ports (23000 and up) the next cluster's proxy uses.
        client_servers = processes_mentioning("ray.util.client.server") & processes_mentioning(f":{port}")
        kill_tree(processes_mentioning(temp_dir) | client_servers, grace_s=RAY_STOP_GRACE_S)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_3d_plan_trains_on_both_nodes_with_tensor_parallel_groups_inside_nodes(two_node_ray, tmp_path):
    """Both nodes train, each reports its own hardware use as MLflow system metrics, and where the
    ranks really ran is logged next to the planned layout.

    4 workers on 2 one-CPU nodes: tp=2 groups fill a node each, the two pipeline stages talk
    across nodes."""
    done = orch_train(f"cluster.address={two_node_ray['gcs']}", "cluster.nodes=2", "cluster.devices_per_node=2",
                      "cluster.cpus_per_worker=0.5", "plan.dp=1", "plan.tp=2", "plan.pp=2", "plan.grad_accum_steps=2",
                      "tracking.system_metrics_interval_s=0.5", cwd=tmp_path, env=two_node_ray["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" not in done.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["nodes_used"] == "2"
    assert run.data.params["cluster.address"] == two_node_ray["gcs"]
    artifacts = client.download_artifacts(run.info.run_id, "plan", str(tmp_path))
    planned = json.loads(Path(artifacts, "placement.json").read_text())["placement"]
    realized = json.loads(Path(artifacts, "placement_realized.json").read_text())["ranks"]
    assert [(r["node"], r["pp_rank"], r["tp_rank"]) for r in planned] == [(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)]
    nodes = [r["node_id"] for r in realized]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # each tp group on one node, as planned
    assert [(r["pp_rank"], r["tp_rank"]) for r in realized] == [(r["pp_rank"], r["tp_rank"]) for r in planned]
    for node in ("node0", "node1"):
        assert run.data.tags[f"system.{node}"]
        cpu = client.get_metric_history(run.info.run_id, f"system/{node}/cpu_utilization_percentage")
        memory = client.get_metric_history(run.info.run_id, f"system/{node}/system_memory_usage_megabytes")
        assert cpu and memory and all(0 <= m.value <= 100 for m in cpu) and all(m.value > 0 for m in memory)
        # Each sample at the training step its node had reached: in order, within the run's 10 steps.
        steps = [m.step for m in cpu]
        assert steps == sorted(steps) and all(0 <= step <= 10 for step in steps), steps
    report = orch_run(["report", run.info.run_id, "--out", "rep"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert report.returncode == 0 and (tmp_path / "rep" / "system.png").exists(), report.stderr[-2000:]
    # A pipeline schedule runs forward, backward and the step in one call: timed, and compared, whole.
    assert run.data.metrics["step_phase/pipeline_s"] > 0
    assert "  pipeline schedule    measured" in report.stdout and (tmp_path / "rep" / "step_time.png").exists()


def test_orch_calibrate_measures_the_link_across_two_nodes(two_node_ray, tmp_path):
    """One worker per node: the all-reduce across the nodes is measured (inside a node there is
    nothing to measure and it stays declared), the profile prices `orch check`, and a run trained
    with it corrects it phase by phase (`orch calibrate --from-run`)."""
    # The probes only (the reference runs are tested on one node, tests/test_tune_e2e.py): the runs
    # that correct the profile here are the user's own, added with --from-run.
    done = orch_run(["calibrate", f"cluster.address={two_node_ray['gcs']}", "cluster.nodes=2",
                     "cluster.devices_per_node=1", f"tune.cache_dir={tmp_path / 'cache'}",
                     "calibrate.references=[]"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "measured 2 node(s), 2 worker(s)" in done.stdout and "across nodes" in done.stdout, done.stdout
    profile = (tmp_path / "tuned_plans" / "cluster" / "calibrated.yaml").read_text()
    assert two_node_ray["gcs"] not in profile  # the address is not stored
    measured = yaml_values(profile)["measured"]
    assert measured["nodes"] == 2 and measured["workers"] == 2
    assert measured["sources"]["inter_node_gbps"].startswith("all-reduce probe across nodes")
    assert measured["sources"]["intra_node_gbps"].startswith("declared (one worker per node")
    assert measured["inter_node_gbps"] > 0 and measured["inter_latency_s"] > 0
    assert measured["inter_all_gather_share"] > 0 and measured["inter_reduce_scatter_share"] > 0
    assert "reduce_scatter_tensor probe" in measured["sources"]["inter_reduce_scatter_share"]
    assert measured["intra_all_gather_share"] == 1.0

    def check() -> dict:
        done = orch_run(["check", "--json", "--config-dir", "tuned_plans",
                         "cluster=calibrated"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)["predicted_step"]

    before = check()
    assert before["speeds"].startswith("measured by `orch calibrate`") and "on 2 node(s), 2 worker(s)" in \
        before["speeds"], before
    # A run trained with the profile tracks its prediction at the profile's speeds and times its
    # phases; `--from-run` records them in the profile, which then corrects each phase's parts.
    done = orch_train(f"cluster.address={two_node_ray['gcs']}", "--config-dir", "tuned_plans", "cluster=calibrated",
                      cwd=tmp_path, env=two_node_ray["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("orch").experiment_id])
    assert run.data.params["step_time.predicted.speeds"] == "measured"
    added = orch_run(["calibrate", "--from-run", run.info.run_id, "--config-dir", "tuned_plans",
                      "cluster=calibrated"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert added.returncode == 0, added.stderr[-3000:]
    assert "forward and backward predicted" in added.stdout, added.stdout
    assert "the profile's corrections now (1 run(s)" in added.stdout
    runs = yaml_values((tmp_path / "tuned_plans" / "cluster" / "calibrated.yaml").read_text())["measured"]["runs"]
    assert [r["run_id"] for r in runs] == [run.info.run_id]
    observed = {phase["phase"]: phase for phase in runs[0]["phases"]}
    after = check()
    assert "corrected by 1 finished run(s)" in after["speeds"]
    # One recorded run: no other run's corrections to predict it with, so no range yet.
    assert after["range_s"]["p10"] is None and "too few for a P10-P90" in after["range_s"]["source"]
    fb = observed["forward and backward"]
    scale = fb["measured_s"] / fb["predicted_s"]
    assert after["parts_s"]["compute"] == pytest.approx(before["parts_s"]["compute"] * scale, rel=1e-4)
    # The same run twice would count it twice: refused, the profile left as it was.
    again = orch_run(["calibrate", "--from-run", run.info.run_id, "--config-dir", "tuned_plans",
                      "cluster=calibrated"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert again.returncode == 2 and "is recorded in the profile already" in again.stderr, again.stderr[-2000:]


def yaml_values(text: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(text))


def test_a_plan_larger_than_the_cluster_fails_clearly(two_node_ray, tmp_path):
    # Read off the live cluster before anything is reserved ...
    done = orch_train(f"cluster.address={two_node_ray['gcs']}", "cluster.devices_per_node=3", cwd=tmp_path,
                      env=two_node_ray["env"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "= 3 workers, but the live cluster has room for 2 1-CPU workers on 2 node(s)" in done.stderr
    # ... and, without discovery, when the placement group cannot be granted within cluster.wait_s.
    done = orch_train(f"cluster.address={two_node_ray['gcs']}", "cluster.devices_per_node=3", "cluster.wait_s=2",
                      "cluster.discover=false", cwd=tmp_path, env=two_node_ray["env"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the plan needs 3 workers with 1 CPU each; the cluster has 2 CPU free" in done.stderr
    # A streamed source's tasks need CPUs beside the workers': none left here would hang its reads.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [os.urandom(32).hex() for _ in range(2000)]}), tmp_path / "rows.parquet")
    done = orch_train(f"cluster.address={two_node_ray['gcs']}", "data=ray", f"data.paths=[{tmp_path / 'rows.parquet'}]",
                      cwd=tmp_path, env=two_node_ray["env"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("data.cpus_per_task=1.0: the data's tasks take 1 CPU(s) beside the workers' 2, but the cluster has 2 "
            "CPU(s) in all") in done.stderr, done.stderr[-3000:]


def env_without_mlflow_credentials() -> dict[str, str]:
    env = worker_env()
    env.pop("MLFLOW_TRACKING_USERNAME", None)
    env.pop("MLFLOW_TRACKING_PASSWORD", None)
    return env


def files_holding(secret: str, *roots: Path) -> list[str]:
    """Every file under ``roots`` whose bytes contain ``secret``."""
    needle = secret.encode()
    return [str(path) for root in roots for path in Path(root).rglob("*")
            if path.is_file() and needle in path.read_bytes()]


def test_credentials_in_the_uri_reach_an_auth_server_and_are_written_nowhere(mlflow_auth_server, tmp_path):
    server, password = mlflow_auth_server, mlflow_auth_server["password"]
    work = tmp_path / "work"  # the commands' working directory: everything they write lands here ...
    work.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # ... or in the embedded Ray's files, or the server's store
    env = {**env_without_mlflow_credentials(), "RAY_TMPDIR": ray_tmp}
    # The same URI from a user's YAML file, for the commands that only read.
    user_conf = tmp_path / "user_conf"
    (user_conf / "tracking").mkdir(parents=True)
    (user_conf / "tracking" / "team.yaml").write_text(
        f"defaults:\n  - tracking_schema\n  - _self_\n\nuri: {server['with_password']}\nexperiment: auth\n")
    try:
        train = orch_train(f"tracking.uri={server['with_password']}", "tracking.experiment=auth", cwd=work, env=env)
        assert train.returncode == 0, train.stderr[-3000:]
        run_id = train.stdout.split("MLflow run ")[1].split()[0]
        commands = [train]
        for args in (["runs", f"tracking.uri={server['with_password']}", "tracking.experiment=auth"],
                     ["report", run_id, "--out", "rep", f"tracking.uri={server['with_password']}"],
                     ["runs", "--config-dir", str(user_conf), "tracking=team", "hydra.run.dir=outputs/team-runs"],
                     ["config", "--config-dir", str(user_conf), "tracking=team", "hydra.run.dir=outputs/team-config"]):
            done = orch_run([*args], cwd=work, env=env, timeout=300)
            assert done.returncode == 0, (args, done.stderr[-3000:])
            commands.append(done)
        assert run_id[:12] in commands[1].stdout and run_id[:12] in commands[3].stdout  # both credentials worked
        assert (work / "rep" / "loss.png").exists()
        printed = "".join(c.stdout + c.stderr for c in commands)
        assert password not in printed
        assert "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD" in train.stderr
        for command in ("team-runs", "team-config"):  # Hydra wrote the YAML file's URI before the command ran
            assert f"uri: {server['url']}\n" in (work / "outputs" / command / ".hydra" / "config.yaml").read_text()
        leaked = files_holding(password, work, ray_tmp, server["store"])
        assert not leaked, leaked
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
        patch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        run = MlflowClient(tracking_uri=server["url"]).get_run(run_id)
    assert run.info.status == "FINISHED"


def test_refused_credentials_are_a_clear_error(mlflow_auth_server, tmp_path, monkeypatch):
    from orch.tracking.store import TrackingError, check_reachable

    url = mlflow_auth_server["url"]
    wrong = f"http://{ADMIN}:Wrong-pw@{url.removeprefix('http://')}"
    done = orch_run(["runs", f"tracking.uri={wrong}"], cwd=tmp_path, env=env_without_mlflow_credentials(), timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"error: tracking.uri={url}: the MLflow server refused the credentials of user 'admin' (HTTP 401). "
            "Fix: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD") in done.stderr
    assert "Traceback" not in done.stderr and "Wrong-pw" not in done.stderr + done.stdout
    # The same through the environment, and with no credentials at all.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "Wrong-pw")
    with pytest.raises(TrackingError, match="refused the credentials of user 'admin'"):
        check_reachable(url)
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    with pytest.raises(TrackingError, match=r"needs credentials and none were given \(HTTP 401\)"):
        check_reachable(url)
    # tracking.fallback=local is for a server that is down, not one that refuses the user.
    from helpers.config import compose_config
    from orch.config import to_typed
    from orch.tracking.train_run import reachable_tracking

    typed, _, _ = to_typed(compose_config(f"tracking.uri={url}", "tracking.fallback=local"))
    with pytest.raises(TrackingError, match="HTTP 401"):
        reachable_tracking(typed)
    # A user the server lets read but not write an experiment: refused when the run starts, not later.
    from mlflow.server.auth.client import AuthServiceClient

    from orch.tracking.store import RunTracker

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", mlflow_auth_server["password"])
    AuthServiceClient(url).create_user("reader", "Reader-pw-12345")
    MlflowClient(tracking_uri=url).create_experiment("admins-only")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "Reader-pw-12345")
    check_reachable(url)  # reading is allowed
    with pytest.raises(TrackingError, match=r"refused a new run in experiment 'admins-only' \(permission denied\)"):
        RunTracker.start(uri=url, experiment="admins-only", run_name=None, params={}, tags={})

def client_session_logs(temp_dir: str) -> set[str]:
    """The log files of the head's client session servers: one per session, each on its own port."""
    return {p.name for p in Path(temp_dir, "session_latest", "logs").glob("ray_client_server_*.out")}


def test_check_reads_the_live_cluster(two_node_ray, tmp_path):
    import json

    done = orch_run(["check", "--json", f"cluster.address={two_node_ray['gcs']}", "cluster.nodes=2",
                     "cluster.devices_per_node=1",
                     "cluster.host_memory_gib=0.5"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["cluster"]["source"] == "live"
    assert doc["cluster"]["host_memory_gib"] > 1  # this machine's memory, not the declared 0.5
    assert any("cluster.host_memory_gib: declared 0.5" in n for n in doc["cluster"]["notes"])
    too_many = orch_run(["check", f"cluster.address={two_node_ray['gcs']}", "cluster.nodes=3",
                         "cluster.devices_per_node=1"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert too_many.returncode == 2 and "the live cluster has room for 2" in too_many.stderr


def test_a_run_tracked_on_a_real_mlflow_server_survives_its_restart_mid_run(tmp_path, monkeypatch):
    """Params, metrics and artifacts reach a real `mlflow server`, nothing lands in a local store,
    and the metrics of the steps that ran while the server was away arrive once it is back."""
    import io

    from helpers.config import compose_config
    from orch.config import to_typed
    from orch.run.driver import run_training

    monkeypatch.chdir(tmp_path)
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    url = f"http://127.0.0.1:{port}"
    servers = [launch_mlflow_server(root, port)]
    wait_healthy(url, servers[0])

    def restart_server_at_step_10_and_wait_for_it_at_20(reports, facts):
        if reports[0].step == 10 and len(servers) == 1:
            stop(servers[0])  # the server goes away mid-run ...
            servers.append(launch_mlflow_server(root, port))  # ... and comes back some seconds later
        elif reports[0].step == 20:
            # Steps 10 and 15 were tracked while it was away. The model uploaded at the run's end is
            # an artifact, not a buffered metric: it needs the server back, which took 46 s on a
            # loaded machine. The workers train on meanwhile; only the driver waits here.
            wait_healthy(url, servers[-1])

    try:
        cfg = compose_config("train.steps=30", "train.log_every=5", "train.eval_batches=1",
                             "plan.micro_batch_size=4", "plan.zero_stage=1", f"tracking.uri={url}",
                             "tracking.experiment=outage")
        out = io.StringIO()
        result = run_training(*to_typed(cfg), on_report=restart_server_at_step_10_and_wait_for_it_at_20, stream=out)
        assert f"{url}/#/experiments/" in out.getvalue()
        client = MlflowClient(tracking_uri=url)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params["plan.zero_stage"] == "1"
        assert [m.step for m in client.get_metric_history(result.run_id, "loss")] == list(range(5, 31, 5))
        assert {a.path for a in client.list_artifacts(result.run_id, "config")} == {
            "config/resolved.yaml", "config/deepspeed.json", "config/optimizer.json"}
        assert not list(tmp_path.glob("mlflow-unsent-*.json"))
        assert not (tmp_path / "mlflow.db").exists()
    finally:
        for proc in servers:
            stop(proc)


def train_worker_pids(temp_dir: str) -> set[int]:
    """This cluster's TrainWorker processes (Ray titles them ``ray::TrainWorker...``)."""
    from helpers.processes import descendants

    pids = set()
    for root in processes_mentioning(temp_dir):
        for pid in descendants(root):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::TrainWorker"):
                        pids.add(pid)
            except OSError:
                continue
    return pids


def test_a_killed_worker_restarts_from_checkpoints_on_s3_through_ray_client(two_node_ray, s3_store, tmp_path):
    """Each node uploads its ranks' part of every checkpoint; the restarted workers download it.

    The head's first session server for this client dies as it starts; the driver tries again."""
    Path(two_node_ray["fail_next_client_session"]).touch()
    sessions_before = client_session_logs(two_node_ray["temp_dir"])
    ckpt = f"s3://{s3_store['bucket']}/killed"
    proc = orch_popen(["train", "train.steps=60", "train.log_every=5", "train.eval_batches=1",
                       "train.checkpoint_every=20", f"train.checkpoint_dir={ckpt}", "train.keep_checkpoints=2",
                       "train.max_failures=1", f"cluster.address={two_node_ray['client']}", "cluster.nodes=2",
                       "cluster.devices_per_node=1"], cwd=tmp_path,
                      env={**two_node_ray["env"], "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "10"}, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    lines, killed = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 20/") and not killed:
                # Step 20's checkpoint is published before its report: a real kill -9 of one worker.
                # The driver prints a step up to one poll (0.5 s) after it ran; the next
                # checkpoint is 20 steps later, far more than the workers run in that time.
                victim = min(train_worker_pids(two_node_ray["temp_dir"]))
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree({proc.pid})
    output = "".join(lines)
    assert proc.returncode == 0 and killed, output[-3000:]
    assert not Path(two_node_ray["fail_next_client_session"]).exists()
    assert "could not start a client session (attempt 1 of 3" in output, output[-3000:]
    # One session per failed attempt and one more: reading the live cluster, training and the
    # restarted workers share a connection. A healthy session server can also miss the head's 25 s
    # start-up limit on a loaded machine (CI saw a second retry); the driver retries that too, and
    # it shows in the output.
    failed = output.count("could not start a client session")
    assert len(client_session_logs(two_node_ray["temp_dir"]) - sessions_before) == failed + 1, output[-3000:]
    assert "restart 1/1: " in output and "resuming from step 20" in output, output[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    assert run.data.tags["nodes_used"] == "2"
    assert run.data.tags["restart.1.resumed_from_step"] == "20"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(5, 61, 5))
    # In the bucket: the two newest tags, each with its manifest, and the record naming the last.
    keys = {o["Key"] for o in s3_store["client"].list_objects_v2(Bucket=s3_store["bucket"],
                                                                 Prefix="killed/")["Contents"]}
    assert {k.split("/")[1] for k in keys} - {""} == {"latest.json", "step_000000040", "step_000000060"}
    assert {"killed/step_000000040/manifest.json", "killed/step_000000060/manifest.json"} <= keys
    latest = json.loads(s3_store["client"].get_object(Bucket=s3_store["bucket"], Key="killed/latest.json")["Body"]
                        .read())
    assert latest["tag"] == "step_000000060" and latest["run_id"] == run.info.run_id
    # The store's credentials reached neither the run's params nor its recorded config.
    secret = s3_store["env"]["AWS_SECRET_ACCESS_KEY"]
    config = Path(client.download_artifacts(run.info.run_id, "config/resolved.yaml", str(tmp_path))).read_text()
    assert secret not in json.dumps(run.data.params) and secret not in config and secret not in output


def test_an_elastic_run_replans_for_the_surviving_node_scales_back_up_and_leaves_a_straggler_out(two_node_ray,
                                                                                                     tmp_path):
    """Two workers a node (ranks 2 and 3 on the second); that node's raylet is killed in step 6, after
    step 4's checkpoint. The run re-plans for the head's two devices at the same global batch, resumes
    step 4's checkpoint (a universal one at the new dp), and when a node joins again, returns to its
    declared plan at the next checkpoint. Rank 3 then turns slow: named a straggler, its node is left
    out at the next checkpoint, and the run ends on the other node. Every sample of the shuffled
    order is trained once: none twice, none skipped."""
    record = tmp_path / "record"
    record.mkdir()
    (record / "kill-raylet-at-batch-6").touch()
    (record / "sleep-per-batch").write_text("0.5")  # the driver asks the group to stop 2 checkpoints later
    # Steps to spare: on a loaded machine the node may rejoin a report later, and the straggler be
    # named a report later, each moving the next plan a checkpoint on.
    steps, checkpoint_every, global_batch = 28, 4, 8
    proc = orch_popen(["train", f"train.steps={steps}", "train.log_every=2", "train.eval_batches=1",
                       f"train.checkpoint_every={checkpoint_every}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                       "train.max_failures=2", "train.elastic.enabled=true", "train.elastic.wait_s=2",
                       "train.elastic.exclude_stragglers=true", "train.export=false", "model=mlp",
                       "model._target_=recording_models.RowRecorder", "model.in_channels=8",
                       f"+model.record_dir={record}", "data=dataset", "data.dataset._target_=recording_models.RowBlobs",
                       "data.dataset.samples=400", "data.dataset.features=8", "objective=classification", "plan.dp=4",
                       "plan.zero_stage=1", "plan.micro_batch_size=2", f"cluster.address={two_node_ray['gcs']}",
                       "cluster.nodes=2", "cluster.devices_per_node=2",
                       "cluster.cpus_per_worker=0.5"], cwd=tmp_path, env=two_node_ray["env"], stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    lines, joined = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("re-plan 1 ") and not joined:
                # A node joins again while the re-planned run trains: it goes back up at its next checkpoint.
                joined.append(subprocess.run([RAY, "start", f"--address={two_node_ray['gcs']}", *NODE],
                                             env={**two_node_ray["env"], "RAY_AUTH_MODE": "token"},
                                             capture_output=True, text=True, timeout=120))
            if line.startswith("re-plan 2 "):
                (record / "slow-rank-3").write_text("0.5")  # from the declared plan's next attempt on
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree({proc.pid})
    output = "".join(lines)
    assert proc.returncode == 0 and joined and joined[0].returncode == 0, output[-4000:]
    assert not (record / "kill-raylet-at-batch-6").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "FINISHED", output[-4000:]
    replans = json.loads(Path(client.download_artifacts(run.info.run_id, "events/replans.json", str(tmp_path)))
                         .read_text())["replans"]
    assert len(replans) == 3, output[-4000:]
    down, up, out = replans
    assert (down["old_devices"], down["new_devices"], down["resumed_from_step"]) == (4, 2, checkpoint_every)
    assert down["old_global_batch"] == down["new_global_batch"] == global_batch
    assert down["new_layout"]["dp"] == 2 and down["predicted_step_s"] > 0 and down["eta_s"] > 0
    assert (up["old_devices"], up["new_devices"]) == (2, 4) and up["resumed_from_step"] % checkpoint_every == 0
    assert up["resumed_from_step"] > checkpoint_every and up["new_layout"] == down["old_layout"]
    assert out["why"].startswith("node left out: rank 3 on ") and "is a straggler: forward +" in out["why"]
    assert (out["old_devices"], out["new_devices"]) == (4, 2) and out["resumed_from_step"] > up["resumed_from_step"]
    assert run.data.tags["replan.1"].startswith("re-plan 1 (2 of 4 devices lost") and "replan.3" in run.data.tags
    assert run.data.tags["straggler.1"].startswith("rank 3 on ")
    assert run.data.metrics["replans"] == 3 and run.data.metrics["goodput/replan_s"] > 0
    assert "converting it to a universal checkpoint for dp=2" in output, output[-4000:]
    # Step 4's report died with the node's ranks before the driver read it; every other is logged once.
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step for m in losses} - {4} == set(range(2, steps + 1, 2)) - {4}
    assert [m.step for m in losses] == sorted({m.step for m in losses}) and losses[-1].value < losses[0].value

    # The data order: one shuffled order of the training rows (DistributedSampler's, seeded with
    # train.seed and the epoch), of which each attempt trained its steps, up to the checkpoint the
    # next resumed. The attempts' files are told apart by when they were last written; a step is
    # ``grad_accum_steps`` lines of a rank's file.
    import torch

    files = sorted(record.glob("rank*.txt"), key=lambda p: p.stat().st_mtime)
    bounds = [0, down["resumed_from_step"], up["resumed_from_step"], out["resumed_from_step"], steps]
    layouts = [down["old_layout"], down["new_layout"], up["new_layout"], out["new_layout"]]
    assert len(files) == sum(layout["dp"] for layout in layouts)
    trained = []
    for first, last, layout in zip(bounds[:-1], bounds[1:], layouts, strict=True):
        attempt_files, files = files[:layout["dp"]], files[layout["dp"]:]
        for path in attempt_files:
            batches = path.read_text().splitlines()[:(last - first) * layout["grad_accum_steps"]]
            assert len(batches) == (last - first) * layout["grad_accum_steps"]
            trained += [int(row) for batch in batches for row in batch.split()]
    order = torch.randperm(360, generator=torch.Generator().manual_seed(1234)).tolist()  # 400 rows, 10% held out
    assert len(trained) == steps * global_batch and sorted(trained) == sorted(order[:steps * global_batch])

    # Without train.elastic, a lost node is what it was: the restart waits cluster.wait_s for the
    # plan's four devices, which two nodes no longer hold, and the run fails saying so.
    again = tmp_path / "record-again"
    again.mkdir()
    (again / "kill-raylet-at-batch-3").touch()
    fixed = orch_run(["train", "train.steps=8", "train.log_every=2", "train.eval_batches=1", "train.checkpoint_every=2",
                      f"train.checkpoint_dir={tmp_path / 'ckpt-again'}", "train.max_failures=1", "train.export=false",
                      "cluster.wait_s=5", "model=mlp", "model._target_=recording_models.RowRecorder",
                      "model.in_channels=8", f"+model.record_dir={again}", "data=dataset",
                      "data.dataset._target_=recording_models.RowBlobs", "data.dataset.samples=400",
                      "data.dataset.features=8", "objective=classification", "plan.dp=4", "plan.zero_stage=1",
                      "plan.micro_batch_size=2", f"cluster.address={two_node_ray['gcs']}", "cluster.nodes=2",
                      "cluster.devices_per_node=2",
                      "cluster.cpus_per_worker=0.5"], cwd=tmp_path, env=two_node_ray["env"], timeout=300)
    assert fixed.returncode == 1 and not (again / "kill-raylet-at-batch-3").exists(), fixed.stdout[-3000:]
    assert "restart 1/1: " in fixed.stdout and "re-plan 1" not in fixed.stdout + fixed.stderr, fixed.stdout[-3000:]
    assert ("a worker was lost and the group could not be placed again: no placement within 5s: the plan needs 4 "
            "workers") in fixed.stderr and "train.elastic.enabled=true re-plans" in fixed.stderr, fixed.stderr[-3000:]
