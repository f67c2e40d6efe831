"""The tracking edge: credentials kept out of the config, and a local store several runs open at once."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys

import pytest
from mlflow.tracking import MlflowClient

from helpers.orch_command import orch_run
from orch.credentials import (
    PASSWORD_ENV,
    USERNAME_ENV,
    CredentialsError,
    move_argv_credentials,
    redact_text,
    split_credentials,
)
from orch.tracking.store import RunTracker, TrackingError, experiment_id_for, open_client

ORCH = shutil.which("orch", path=os.path.dirname(sys.executable)) or "orch"


@pytest.fixture
def clean_env(monkeypatch):
    """MLflow's credential variables unset, and restored after the test (unset again when they were:
    monkeypatch records nothing for a variable it deletes that is not there, so the ones a test's
    code sets would outlive it and reach later tests in the same process)."""
    for name in (USERNAME_ENV, PASSWORD_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_credentials_leave_the_uri_decoded_and_the_rest_intact():
    clean, creds = split_credentials("http://alice:p%40ss%3Aw@[::1]:5000/mlflow?x=1")
    assert clean == "http://[::1]:5000/mlflow?x=1"
    assert (creds.username, creds.password) == ("alice", "p@ss:w")
    assert "p@ss" not in repr(creds)
    assert split_credentials("sqlite:///mlflow.db") == ("sqlite:///mlflow.db", None)
    assert split_credentials("http://u:p@h:port")[0] == "http://h:port"  # a bad host is MLflow's to report
    assert split_credentials("https://u:p@[::1")[0] == "https://[::1"


def test_redacting_text_removes_every_userinfo_and_nothing_else():
    text = ("tracking:\n  uri: 'http://u:se@cret@host:5000/x'\ncluster:\n  address: ray://a:b@head:10001\n"
            "note: mail me at x@y, see https://example.org/a@b\n")
    assert redact_text(text) == ("tracking:\n  uri: 'http://host:5000/x'\ncluster:\n  address: ray://head:10001\n"
                                 "note: mail me at x@y, see https://example.org/a@b\n")
    # Hydra escapes ":" in the overrides a sweep job records.
    assert redact_text("- cluster.address=ray\\://u\\:pw@h\\:1") == "- cluster.address=ray\\://h\\:1"


def test_command_line_credentials_move_to_mlflows_environment_variables(clean_env, capsys):
    argv = ["plan.dp=2", "tracking.uri=http://bob:Secret-1@127.0.0.1:5000", "++tracking.uri=https://bob:Secret-1@h/"]
    assert move_argv_credentials(argv) == ["plan.dp=2", "tracking.uri=http://127.0.0.1:5000",
                                           "++tracking.uri=https://h/"]
    assert (os.environ[USERNAME_ENV], os.environ[PASSWORD_ENV]) == ("bob", "Secret-1")
    assert "Secret-1" not in capsys.readouterr().err
    # Only tracking.uri is rewritten: another key's value is the user's business.
    assert move_argv_credentials(["tracking.experiment=a:b@c"]) == ["tracking.experiment=a:b@c"]


def test_a_database_store_keeps_its_password_in_the_uri(clean_env):
    # SQLAlchemy reads no MLFLOW_TRACKING_* variable: moved there, the password would be lost.
    # The written copies are scrubbed instead (test_no_written_or_printed_copy_of_the_config...).
    argv = ["tracking.uri=postgresql://bob:Secret-1@db:5432/mlflow"]
    assert move_argv_credentials(argv) == argv
    assert USERNAME_ENV not in os.environ
    assert redact_text(argv[0]) == "tracking.uri=postgresql://db:5432/mlflow"


def test_a_sweep_over_different_credentials_is_refused(clean_env):
    with pytest.raises(CredentialsError, match="different credentials"):
        move_argv_credentials(["tracking.uri=http://a:1@h1:5000,http://b:2@h2:5000"])
    assert USERNAME_ENV not in os.environ


def test_an_unknown_tracking_scheme_is_a_user_error():
    with pytest.raises(TrackingError, match=r"tracking.uri=ftp://x: MLflow cannot track there \(no MLflow store "
                                            r"for the scheme 'ftp'\)\. Fix: use sqlite:///mlflow.db"):
        open_client("ftp://x")


def _start_run(uri: str, barrier, results) -> None:
    """One `orch train`'s first contact with the store, as RunTracker.start makes it."""
    barrier.wait()
    try:
        tracker = RunTracker.start(uri=uri, experiment="orch", run_name=None, params={"a": "1"}, tags={})
        tracker.finish()
        results.put("ok")
    except BaseException as exc:  # reported to the test, which shows what went wrong
        results.put(f"{type(exc).__name__}: {exc}"[:2000])


def test_runs_started_at_once_on_a_fresh_sqlite_store_all_succeed(tmp_path):
    # Without the lock, MLflow's schema migration of a new sqlite file fails in the processes
    # that race the first one (duplicate column, or alembic finding no version row).
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    starts = 4
    context = multiprocessing.get_context("spawn")  # each its own interpreter, like separate commands
    barrier, results = context.Barrier(starts), context.Queue()
    procs = [context.Process(target=_start_run, args=(uri, barrier, results)) for _ in range(starts)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes == ["ok"] * starts, outcomes
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("orch")
    assert len(client.search_runs([experiment.experiment_id])) == starts
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["mlflow.db"]  # no lock file left behind


def test_report_takes_the_short_run_ids_orch_runs_shows_and_refuses_an_ambiguous_one(tmp_path):
    """`orch runs` shows 12 characters of each id; `orch report` takes them, or any prefix naming
    one run, and refuses a prefix shared by several runs, listing them."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = experiment_id_for(client, "orch")
    runs: dict[str, list[str]] = {}
    while not any(len(ids) > 1 for ids in runs.values()):  # two ids that start alike (a few runs at most)
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "loss", 1.0, step=1)
        client.set_terminated(run.info.run_id)
        runs.setdefault(run.info.run_id[0], []).append(run.info.run_id)
    shared, alike = next((first, ids) for first, ids in runs.items() if len(ids) > 1)

    def orch(*args):
        return orch_run([*args], cwd=tmp_path, timeout=300)

    listed = orch("runs")
    assert listed.returncode == 0 and alike[0][:12] in listed.stdout and alike[0] not in listed.stdout, listed.stdout
    report = orch("report", alike[0][:12])
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"run        {alike[0]} " in report.stdout and (tmp_path / "reports" / alike[0] / "loss.png").exists()
    ambiguous = orch("report", shared)
    assert ambiguous.returncode == 2, ambiguous.stderr
    assert f"error: run id {shared!r}: the ids of {len(alike)} runs start with it: " in ambiguous.stderr
    assert all(run_id in ambiguous.stderr for run_id in alike) and "Fix: give more of the id" in ambiguous.stderr
    unknown = orch("export", "0000000000ab")
    assert unknown.returncode == 2 and "run id '0000000000ab': no run in tracking.uri=" in unknown.stderr, \
        unknown.stderr


def test_no_written_or_printed_copy_of_the_config_holds_a_password(tmp_path):
    # Hydra writes the overrides and the composed config to outputs/*/.hydra/ before any of
    # orch's code runs; a Ray address with userinfo stays usable in memory but is scrubbed there.
    secret = "Pw-5e2b1c"
    done = orch_run(["config", f"tracking.uri=http://u:{secret}@h:5000", f"cluster.address=ray://u:{secret}@head:10001",
                     "hydra.run.dir=out"], cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "uri: http://h:5000\n" in done.stdout and "address: ray://head:10001\n" in done.stdout
    assert secret not in done.stdout + done.stderr
    written = {p.name: p.read_text() for p in (tmp_path / "out" / ".hydra").iterdir()}
    assert sorted(written) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert all(secret not in text for text in written.values()), written
    assert "ray://head:10001" in written["overrides.yaml"]


class _RacedClient(MlflowClient):
    """A client that looks for the experiment just before another run creates it."""

    def get_experiment_by_name(self, name):
        found = super().get_experiment_by_name(name)
        if not getattr(self, "raced", False):
            self.raced = True
            MlflowClient(tracking_uri=self.tracking_uri).create_experiment(name)
        return found


def test_an_experiment_created_meanwhile_by_another_run_is_used(tmp_path):
    client = _RacedClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = experiment_id_for(client, "orch")
    assert experiment_id == client.get_experiment_by_name("orch").experiment_id


def test_a_sampler_finished_before_it_started_keeps_one_sample():
    # A run resumed at its last step runs no step, so its sampler never starts; it still records.
    from orch.launchers.system_metrics import SystemSampler

    sampler = SystemSampler(3600)
    sampler.finish()
    sample, = sampler.take()
    assert sample["system_memory_usage_megabytes"] > 0 and 0 <= sample["cpu_utilization_percentage"] <= 100
    assert sampler.take() == []


def test_a_sqlite_store_that_cannot_be_created_is_a_declared_value_problem(tmp_path):
    """Checked without MLflow or torch, so `orch train` and `orch tune` refuse it before their imports,
    together with the declared values' and the plan arithmetic's problems."""
    from helpers.config import compose_config
    from orch.config import TrackingConfig, to_typed
    from orch.declared import declared_and_plan_violations
    from orch.tracking.local_store import local_store_violations

    (tmp_path / "kept.db").write_bytes(b"")
    for uri in (f"sqlite:///{tmp_path}/new/dir/mlflow.db", f"sqlite:///{tmp_path}/kept.db", "sqlite:///:memory:",
                "http://127.0.0.1:1", str(tmp_path / "mlruns")):
        assert local_store_violations(TrackingConfig(uri=uri)) == [], uri
    assert local_store_violations(TrackingConfig(uri="sqlite:////proc/orch.db", enabled=False)) == []
    [violation] = local_store_violations(TrackingConfig(uri="sqlite:////proc/deeper/orch.db"))
    assert violation.field == "tracking.uri" and violation.value == "sqlite:////proc/deeper/orch.db"
    assert "its closest existing parent /proc is a directory this user cannot create files in" in violation.message
    typed = to_typed(compose_config("train.steps=0", "plan.zero_stage=7"))[0]
    assert {v.field for v in declared_and_plan_violations(typed)} == {"train.steps", "plan.zero_stage"}
