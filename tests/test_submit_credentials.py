"""`orch submit` and credentials: nothing secret travels with a job, and the tracking server is
checked before anything is submitted.

A job's command line and environment sit in Ray's job table, which the dashboard, `ray job list`
and the head's logs show to anyone who can reach the cluster. The pure rules, and the job
commands' own files and output; the jobs submitted to a real Ray head whose environment holds the
tracking server's credentials are in tests/test_submit.py.
"""

from __future__ import annotations

import pytest
from test_cluster import env_without_mlflow_credentials, files_holding

from helpers.config import compose_config
from helpers.orch_command import orch_run
from helpers.processes import free_port
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.submit import check_tracking, shipped_credentials, submission, submitted_message

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
    done = orch_run([*command, f"cluster.address=http://ops:{SECRET}@127.0.0.1:{port}"], cwd=tmp_path,
                    env=env_without_mlflow_credentials(), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cluster.address=http://127.0.0.1:{port}" in done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert files_holding(SECRET, tmp_path) == []
