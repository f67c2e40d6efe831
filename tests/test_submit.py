"""`orch submit` and its job commands: the pure checks, then a real Ray head with its Jobs server
on loopback whose environment holds the credentials of a real MLflow server behind basic
authentication: a job that trains the user's own model from a shipped working directory and
tracks to that server while the password given here travels nowhere, a plan refused before
anything is submitted, a job stopped mid-run, and the tracking server checked before submitting
(the credential rules that need no cluster: tests/test_submit_credentials.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_cluster import env_without_mlflow_credentials, files_holding

from helpers.config import compose_config
from helpers.orch_command import orch_run
from helpers.processes import RAY_STOP_GRACE_S, free_port, kill_tree, processes_mentioning, worker_env
from helpers.projects import plant_packages_named_like_orchs_parts
from helpers.tracking_server import ADMIN
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.submit import submission, submit_violations

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def test_paths_a_job_cannot_reach_are_refused_with_the_fix():
    typed, _, _ = to_typed(compose_config())
    assert [v.field for v in submit_violations(typed)] == ["tracking.uri"]  # no checkpoints: no checkpoint_dir
    typed, _, _ = to_typed(compose_config("train.checkpoint_every=10"))
    found = {v.field: v for v in submit_violations(typed)}
    assert set(found) == {"tracking.uri", "train.checkpoint_dir"}
    assert "sqlite:////shared/mlflow.db" in found["tracking.uri"].fix
    typed, _, _ = to_typed(compose_config("tracking.uri=http://mlflow:5000", "train.checkpoint_dir=/shared/ckpt"))
    assert submit_violations(typed) == []


def test_a_submitted_tune_must_write_its_plan_where_the_user_reaches_it(tmp_path):
    """Without tune.out the plan file went into the head's copy of the working directory (Ray's
    package cache), and the printed `orch train --config-dir tuned_plans plan=tuned` failed here."""
    typed, _, _ = to_typed(compose_config("tracking.uri=http://mlflow:5000"))
    [refused] = submit_violations(typed, "tune")
    assert refused.field == "tune.out" and "s3://bucket/plans/plan/tuned.yaml" in refused.fix
    for out in ("s3://bucket/plans/plan/tuned.yaml", "/shared/plans/plan/tuned.yaml"):
        typed, _, _ = to_typed(compose_config("tracking.uri=http://mlflow:5000", f"tune.out={out}"))
        assert submit_violations(typed, "tune") == []
    # As a user runs it: refused before anything is submitted, even with no cluster answering there.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"cluster.address=http://127.0.0.1:{unused.getsockname()[1]}"
        done = orch("submit", "--tune", address, "tracking.uri=http://mlflow:5000", "tune.out=tuned_plans/plan/t.yaml",
                    cwd=tmp_path, env=worker_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tune.out='tuned_plans/plan/t.yaml'" in done.stderr and "submitted job" not in done.stdout


def test_the_job_runs_orch_on_the_cluster_it_is_on_from_the_shipped_directory(tmp_path):
    (tmp_path / "conf").mkdir()
    typed, _, _ = to_typed(compose_config("submit.pip=[einops]", "+submit.env.MY_FLAG=1"))
    job = submission("train", ["model=mine", "cluster.address=http://head:8265", "plan.zero_stage=2"], typed.submit,
                     "conf", tmp_path)
    assert job.entrypoint == "orch train --config-dir conf model=mine plan.zero_stage=2 cluster.address=auto"
    assert job.runtime_env["working_dir"] == str(tmp_path) and ".venv" in job.runtime_env["excludes"]
    assert job.runtime_env["pip"] == ["einops"] and job.runtime_env["env_vars"] == {"MY_FLAG": "1"}
    with pytest.raises(PlanError, match="--config-dir"):
        submission("train", [], typed.submit, str(tmp_path.parent), tmp_path)


OWN_MODEL = '''
import torch


class Tiny(torch.nn.Module):
    """A user's own model, known to the cluster only through the shipped working directory."""

    def __init__(self, vocab_size: int = 256, width: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, vocab_size)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))
'''


@contextlib.contextmanager
def ray_jobs_head(env: dict[str, str]) -> Iterator[dict]:
    """A Ray head with its dashboard (the Jobs server) on loopback, token auth on, started with
    ``env`` (plus ``PATH`` to this environment, so the job's `orch` is the one under test): its
    address, the ``env`` for `orch` commands that reach it, and its temp dir (its logs).

    Every port it listens on is free or its own: the dashboard agent's fixed default (52365)
    held by another Ray on the machine leaves the head without an agent to run jobs ("No
    available agent to submit job"), and its client proxy's (10001) without a proxy.
    """
    port, dashboard, agent, client_port = free_port(), free_port(), free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    token = Path(temp_dir, "auth_token")
    token.write_text(secrets.token_hex(32))
    env = {**env, "RAY_AUTH_TOKEN_PATH": str(token),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"}
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                        f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client_port}",
                        f"--temp-dir={temp_dir}", "--num-cpus=2", "--object-store-memory=300000000",
                        "--disable-usage-stats"], env={**env, "RAY_AUTH_MODE": "token"}, check=True,
                       capture_output=True, timeout=180)
        yield {"address": f"http://127.0.0.1:{dashboard}", "env": env, "temp_dir": temp_dir}
    finally:
        # The client proxy names the GCS port, not the temp dir.
        client_servers = processes_mentioning("ray.util.client.server") & processes_mentioning(f":{port}")
        kill_tree(processes_mentioning(temp_dir) | client_servers, grace_s=RAY_STOP_GRACE_S)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def jobs_head(mlflow_auth_server):
    """A Ray head started from this environment with the tracking server's credentials added to its
    own: the safe way to give jobs credentials. ``env``, for the commands run here, holds none."""
    credentials = {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": mlflow_auth_server["password"]}
    with ray_jobs_head({**env_without_mlflow_credentials(), **credentials}) as head:
        yield {**head, "env": {k: v for k, v in head["env"].items() if not k.startswith("MLFLOW_TRACKING_")}}


def job_info(head: dict, job_id: str) -> dict:
    """What the Jobs API tells anyone who lists the job, asked from a process of its own (this
    one's Ray client state is the embedded clusters', without the head's token)."""
    done = subprocess.run(
        [sys.executable, "-c", "import json, sys; from ray.job_submission import JobSubmissionClient; "
         "info = JobSubmissionClient(sys.argv[1]).get_job_info(sys.argv[2]); "
         "print(json.dumps({'entrypoint': info.entrypoint, 'runtime_env': info.runtime_env, "
         "'metadata': info.metadata}))", head["address"], job_id],
        env={**head["env"], "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def orch(*args: str, cwd, env) -> subprocess.CompletedProcess:
    return orch_run([*args], cwd=cwd, env=env, timeout=600)


def user_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "conf" / "model").mkdir(parents=True)
    (project / "tiny.py").write_text(OWN_MODEL)
    (project / "conf" / "model" / "tiny.yaml").write_text("_target_: tiny.Tiny\nwidth: 32\n")
    return project


@pytest.mark.slow
@pytest.mark.cluster
def test_a_submitted_job_trains_the_users_own_code_with_the_clusters_credentials_and_can_be_stopped(
        jobs_head, mlflow_auth_server, tmp_path):
    """The job tracks to a server behind basic authentication with the credentials of the head's
    own environment; the password given here to `orch submit` is printed, shipped and listed
    nowhere. Then the job commands, a plan refused before submitting, and a job stopped mid-run."""
    head, server, password = jobs_head, mlflow_auth_server, mlflow_auth_server["password"]
    project = user_project(tmp_path)
    # Its own packages named like orch's parts ship with it and are first on the job's import path.
    plant_packages_named_like_orchs_parts(project)
    # Secrets a project directory often holds stay behind (submit.excludes' defaults).
    (project / ".env").write_text("MLFLOW_TRACKING_PASSWORD=never-shipped\n")
    (project / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    address = f"cluster.address={head['address']}"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # absolute: the head shares this machine's disk
    common = ["--config-dir", "conf", "model=tiny", address, f"train.checkpoint_dir={tmp_path / 'ckpt'}",
              "train.log_every=5"]
    tracked = [f"tracking.uri={server['with_password']}", "tracking.experiment=submitted", "train.steps=10"]
    done = orch("submit", "--wait", *common, *tracked, cwd=project, env=head["env"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the job used the cluster's credentials
    assert password not in done.stdout + done.stderr
    job_id = done.stdout.split("submitted job ", 1)[1].split()[0]
    assert f"orch logs {job_id} --follow" in done.stdout and f"job {job_id} ended SUCCEEDED" in done.stdout
    info = job_info(head, job_id)
    assert info["entrypoint"] == (f"orch train --config-dir conf model=tiny train.checkpoint_dir={tmp_path / 'ckpt'} "
                                  f"train.log_every=5 tracking.uri={server['url']} tracking.experiment=submitted "
                                  "train.steps=10 cluster.address=auto")
    assert password not in json.dumps(info)
    assert ("note: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD checked tracking.uri="
            f"{server['url']} from here but are not sent with the job") in done.stderr, done.stderr[-3000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
        patch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        client = MlflowClient(tracking_uri=server["url"])
        [run] = client.search_runs([client.get_experiment_by_name("submitted").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["model._target_"] == "tiny.Tiny"
    logs = orch("logs", job_id, address, cwd=project, env=head["env"])
    assert "done: 10 steps" in logs.stdout
    assert password not in "".join(c.stdout + c.stderr for c in (done, logs))
    leaked = files_holding(password, project, head["temp_dir"], server["store"])  # the head's job-driver logs too
    assert not leaked, leaked
    for unknown in (["logs", "raysubmit_bogus"], ["logs", "raysubmit_bogus", "--follow"]):
        refused = orch(*unknown, address, cwd=project, env=head["env"])
        assert refused.returncode == 2 and "raysubmit_bogus" in refused.stderr, (unknown, refused.stderr[-1000:])
    shipped = list(Path(head["temp_dir"]).rglob("tiny.py"))
    assert shipped and not [p for p in Path(head["temp_dir"]).rglob("*") if p.name in (".env", "deploy.pem")]

    # A job that carries a password already (submitted by other means): `orch jobs` and `orch logs` mask it.
    raw = subprocess.run(
        [sys.executable, "-c", "import sys; from ray.job_submission import JobSubmissionClient; "
         "print(JobSubmissionClient(sys.argv[1]).submit_job(entrypoint=sys.argv[2]))", head["address"],
         f"echo tracking.uri=http://{ADMIN}:{password}@mlflow:5000"],
        env={**head["env"], "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
    assert raw.returncode == 0, raw.stderr[-2000:]
    old_id = raw.stdout.strip().splitlines()[-1]
    followed = orch("logs", old_id, "--follow", address, cwd=project, env=head["env"])
    listed = orch("jobs", address, cwd=project, env=head["env"])
    assert job_id in listed.stdout and "SUCCEEDED" in listed.stdout  # the job submitted above, listed with its end
    assert "echo tracking.uri=http://mlflow:5000" in listed.stdout
    assert "tracking.uri=http://mlflow:5000" in followed.stdout
    assert password not in "".join(c.stdout + c.stderr for c in (followed, listed))

    # A plan that cannot fit is refused here: nothing reaches the cluster.
    local = [*common, f"tracking.uri={store}"]
    refused = orch("submit", *local, "plan.micro_batch_size=100000", cwd=project, env=head["env"])
    assert refused.returncode == 2 and "submitted job" not in refused.stdout, refused.stderr[-2000:]
    # Stopped mid-run: the run ends KILLED and its workers are gone.
    started = orch("submit", *local, "train.steps=1000000", "tracking.experiment=long", cwd=project, env=head["env"])
    assert started.returncode == 0, started.stderr[-3000:]
    long_id = started.stdout.split("submitted job ", 1)[1].split()[0]
    client = MlflowClient(tracking_uri=store)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        experiment = client.get_experiment_by_name("long")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        if runs and client.get_metric_history(runs[0].info.run_id, "loss"):
            break
        time.sleep(0.5)
    else:
        pytest.fail("the long job never reported a step")
    stopped = orch("stop", long_id, address, cwd=project, env=head["env"])
    assert stopped.returncode == 0 and f"job {long_id}: STOPPED" in stopped.stdout, stopped.stderr[-2000:]
    assert client.get_run(runs[0].info.run_id).info.status == "KILLED"
    # Asked from a process of its own: this one's Ray client state is the embedded clusters' (no token).
    actors = subprocess.run([sys.executable, "-c", "from ray.util.state import list_actors; import sys; "
                             "print([a.class_name for a in list_actors(address=sys.argv[1], "
                             "filters=[('state', '=', 'ALIVE')])])", head["address"]],
                            env={**head["env"], "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                            timeout=120)
    assert actors.returncode == 0 and "TrainWorker" not in actors.stdout, actors.stdout + actors.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.cluster
def test_submit_checks_the_tracking_server_and_refuses_to_ship_credentials(jobs_head, mlflow_auth_server, tmp_path):
    head, server, password = jobs_head, mlflow_auth_server, mlflow_auth_server["password"]
    project = user_project(tmp_path)
    common = ["--config-dir", "conf", "model=tiny", f"cluster.address={head['address']}", "train.steps=5",
              f"tracking.uri={server['url']}"]

    # Credentials here that the server refuses: refused here, as `orch train` refuses them.
    wrong = orch("submit", *common, cwd=project,
                 env={**head["env"], "MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": "Wrong-pw"})
    assert wrong.returncode == 2 and "submitted job" not in wrong.stdout, wrong.stdout + wrong.stderr[-3000:]
    assert (f"error: tracking.uri={server['url']}: the MLflow server refused the credentials of user 'admin' "
            "(HTTP 401). Fix: correct or unset MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD here (they "
            "only check the server: the job uses the cluster's own)") in wrong.stderr

    # A password in submit.env would sit in the job table: refused, by name, before Hydra records it.
    shipped = orch("submit", *common, f"+submit.env.MLFLOW_TRACKING_PASSWORD={password}", cwd=project,
                   env=head["env"])
    assert shipped.returncode == 2 and "submitted job" not in shipped.stdout, shipped.stderr[-3000:]
    assert "  - submit.env.MLFLOW_TRACKING_PASSWORD (its name holds PASSWORD). Fix: " in shipped.stderr
    assert password not in shipped.stdout + shipped.stderr
    assert files_holding(password, project) == []

    # No credentials here: the server wants some, and the job is told where it finds them.
    plain = orch("submit", *common, cwd=project, env=head["env"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert (f"note: tracking.uri={server['url']} needs credentials (HTTP 401) and a submitted job takes none from "
            "here: the job uses MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) from "
            "the cluster's own environment") in plain.stderr
