"""`orch submit` and credentials: nothing secret travels with a job, and the tracking server is
checked before anything is submitted.

A job's command line and environment sit in Ray's job table, which the dashboard, `ray job list`
and the head's logs show to anyone who can reach the cluster. The pure rules first, then the
job commands' own files and output, then a real Ray head whose environment holds the tracking
server's credentials (the safe way) and a real MLflow server behind basic authentication.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from test_cluster import env_without_mlflow_credentials, files_holding
from test_submit import orch, ray_jobs_head, user_project

from helpers.config import compose_config
from helpers.processes import free_port
from helpers.tracking_server import ADMIN
from orchestrator.config import to_typed
from orchestrator.submit import check_tracking, shipped_credentials, submission, submitted_message
from plans.errors import PlanError

SECRET = "Pw-not-to-be-seen-1234"
CLUSTER_FIX = ("keep the credentials in the cluster's own environment (where `ray start` runs on the head node) "
               "or your secrets mechanism; see docs/reliability.md, Submitted jobs")


def test_credentials_in_an_override_never_reach_the_jobs_command_line(tmp_path):
    typed, _, _ = to_typed(compose_config())
    with pytest.raises(PlanError) as refused:
        submission("train", [f"tracking.uri=postgresql://orch:{SECRET}@db/mlflow", "plan.zero_stage=2"],
                   typed.submit, None, tmp_path)
    assert [str(v) for v in refused.value.violations] == [
        "tracking.uri='postgresql://db/mlflow': holds a user:password@, which would be shipped in the job's command "
        "line: Ray shows it to anyone who can list the cluster's jobs (dashboard, `ray job list`, the head's logs). "
        f"Fix: give tracking.uri without the user:password@ and {CLUSTER_FIX}"]
    # The job runs against the cluster it is on: an address, in any override form, is replaced, never shipped.
    job = submission("train", [f"++cluster.address=http://u:{SECRET}@head:8265", "plan.zero_stage=2"], typed.submit,
                     None, tmp_path)
    assert job.entrypoint == "orch train plan.zero_stage=2 cluster.address=auto"


def test_credential_names_in_submit_env_are_refused_naming_the_variable_never_its_value():
    names = ["MLFLOW_TRACKING_PASSWORD", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY"]
    typed, _, _ = to_typed(compose_config(*(f"+submit.env.{name}={SECRET}" for name in names),
                                          f"+submit.env.DATABASE_URL=postgresql://orch:{SECRET}@db/x",
                                          "+submit.env.NCCL_DEBUG=INFO"))
    found = shipped_credentials([], dict(typed.submit.env))
    assert sorted((v.field, v.value) for v in found) == sorted(("submit.env", n) for n in [*names, "DATABASE_URL"])
    assert SECRET not in str(PlanError(found))
    by_name = {v.value: str(v) for v in found}
    assert by_name["MLFLOW_TRACKING_PASSWORD"] == (
        "submit.env='MLFLOW_TRACKING_PASSWORD': its name holds PASSWORD: it looks like a credential, and Ray keeps a "
        "job's environment in its job table, readable by anyone who can list the cluster's jobs. Fix: remove "
        f"MLFLOW_TRACKING_PASSWORD from submit.env and {CLUSTER_FIX}")
    assert by_name["DATABASE_URL"].startswith("submit.env='DATABASE_URL': its value holds a user:password@, ")


def test_a_tracking_uri_with_credentials_from_a_shipped_config_file_is_refused():
    [found] = shipped_credentials([], {}, f"http://admin:{SECRET}@mlflow:5000")
    assert str(found) == (
        "tracking.uri='http://mlflow:5000': holds a user:password@ from a config file, which would be shipped to the "
        f"cluster with the working directory. Fix: remove the user:password@ from the file and {CLUSTER_FIX}")
    # An interpolation resolves where the job runs, from the cluster's environment: nothing is shipped.
    assert shipped_credentials(["tracking.uri=${oc.env:TRACKING_URI}"], {}, "${oc.env:TRACKING_URI}") == []


def test_what_submit_prints_names_the_address_without_its_password():
    text = submitted_message("raysubmit_1", f"http://ops:{SECRET}@head:8265", "orch train cluster.address=auto",
                             address_given=True)
    assert text == (
        "submitted job raysubmit_1 to http://head:8265: orch train cluster.address=auto\n"
        "  follow it: orch logs raysubmit_1 --follow cluster.address=http://head:8265\n"
        "  stop it:   orch stop raysubmit_1 cluster.address=http://head:8265\n"
        "  all jobs:  orch jobs cluster.address=http://head:8265\n"
        "  (cluster.address is shown without its user:password@: give it as you did here)")


def test_a_tracking_server_that_does_not_answer_here_is_left_to_the_cluster_to_check():
    port = free_port()  # nothing listens there
    typed, _, _ = to_typed(compose_config(f"tracking.uri=http://127.0.0.1:{port}"))
    assert check_tracking(typed) == [
        f"warning: tracking.uri=http://127.0.0.1:{port}: no MLflow server answers there (Connection refused); not "
        "checked from here: the job checks it on the cluster before it trains (the cluster may reach a server this "
        "machine does not)"]


@pytest.mark.parametrize("command", [["jobs"], ["logs", "raysubmit_x"], ["stop", "raysubmit_x"],
                                     ["submit", "tracking.uri=http://127.0.0.1:1"]])
def test_job_commands_keep_a_password_in_the_address_out_of_what_they_print_and_write(command, tmp_path):
    port = free_port()  # no Jobs server: each command fails, after Hydra wrote its copies of the overrides
    done = subprocess.run([sys.executable, "-m", "orchestrator", *command,
                           f"cluster.address=http://ops:{SECRET}@127.0.0.1:{port}"], cwd=tmp_path,
                          env=env_without_mlflow_credentials(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cluster.address=http://127.0.0.1:{port}" in done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert files_holding(SECRET, tmp_path) == []


@pytest.fixture(scope="module")
def head_with_tracking_credentials(mlflow_auth_server):
    """A Ray head started with the tracking server's credentials in its environment: the safe way.
    ``env`` is that of this machine, which holds none."""
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


@pytest.mark.slow
@pytest.mark.cluster
def test_a_password_given_to_submit_is_printed_shipped_and_listed_nowhere(head_with_tracking_credentials,
                                                                         mlflow_auth_server, tmp_path):
    head, server, password = head_with_tracking_credentials, mlflow_auth_server, mlflow_auth_server["password"]
    project = user_project(tmp_path)
    address = f"cluster.address={head['address']}"
    overrides = ["--config-dir", "conf", "model=tiny", f"tracking.uri={server['with_password']}",
                 "tracking.experiment=submitted", "train.steps=5", "train.log_every=5"]

    done = orch("submit", "--wait", *overrides, address, cwd=project, env=head["env"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the job used the cluster's credentials
    assert password not in done.stdout + done.stderr
    job_id = done.stdout.split("submitted job ", 1)[1].split()[0]
    info = job_info(head, job_id)
    assert info["entrypoint"] == (f"orch train --config-dir conf model=tiny tracking.uri={server['url']} "
                                  "tracking.experiment=submitted train.steps=5 train.log_every=5 cluster.address=auto")
    assert password not in json.dumps(info)
    assert ("note: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD checked tracking.uri="
            f"{server['url']} from here but are not sent with the job") in done.stderr
    listed = orch("jobs", address, cwd=project, env=head["env"])
    logs = orch("logs", job_id, address, cwd=project, env=head["env"])
    assert job_id in listed.stdout and "done: 5 steps" in logs.stdout
    assert password not in "".join(c.stdout + c.stderr for c in (done, listed, logs))
    leaked = files_holding(password, project, head["temp_dir"], server["store"])  # the head's job-driver logs too
    assert not leaked, leaked
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
        patch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        client = MlflowClient(tracking_uri=server["url"])
        [run] = client.search_runs([client.get_experiment_by_name("submitted").experiment_id])
    assert run.info.status == "FINISHED"

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
    assert "echo tracking.uri=http://mlflow:5000" in listed.stdout
    assert "tracking.uri=http://mlflow:5000" in followed.stdout
    assert password not in "".join(c.stdout + c.stderr for c in (followed, listed))


@pytest.mark.slow
@pytest.mark.cluster
def test_submit_checks_the_tracking_server_and_refuses_to_ship_credentials(head_with_tracking_credentials,
                                                                          mlflow_auth_server, tmp_path):
    head, server, password = head_with_tracking_credentials, mlflow_auth_server, mlflow_auth_server["password"]
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

    # A password in submit.env would sit in the job table: refused, by name.
    shipped = orch("submit", *common, f"+submit.env.MLFLOW_TRACKING_PASSWORD={password}", cwd=project,
                   env=head["env"])
    assert shipped.returncode == 2 and "submitted job" not in shipped.stdout, shipped.stderr[-3000:]
    assert "submit.env='MLFLOW_TRACKING_PASSWORD': its name holds PASSWORD" in shipped.stderr
    assert password not in shipped.stdout + shipped.stderr

    # No credentials here: the server wants some, and the job is told where it finds them.
    plain = orch("submit", *common, cwd=project, env=head["env"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert (f"note: tracking.uri={server['url']} needs credentials (HTTP 401) and a submitted job takes none from "
            "here: the job uses MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) from "
            "the cluster's own environment") in plain.stderr

