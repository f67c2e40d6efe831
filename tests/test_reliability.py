"""Checkpoints, resume and automatic restart, with real workers killed for real."""

from __future__ import annotations

import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from conftest import compose_config
from launchers.checkpoint import LATEST, latest, publish, tag_for
from orchestrator.config import to_typed
from orchestrator.driver import run_training

RUN = ["train.steps=30", "train.log_every=5", "train.eval_batches=1", "plan.micro_batch_size=4",
       "plan.zero_stage=1", "train.checkpoint_every=10"]


def test_publish_is_atomic_and_prunes(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / tag_for(step)).mkdir()
        publish(tmp_path, step, "run-1", keep=2)
    record = latest(tmp_path)
    assert record.step == 30 and record.tags == [tag_for(20), tag_for(30)] and record.run_id == "run-1"
    assert not (tmp_path / tag_for(10)).exists() and (tmp_path / tag_for(20)).exists()
    # An interrupted save leaves a half-written tag directory and maybe a temp file: neither counts.
    (tmp_path / tag_for(40)).mkdir()
    (tmp_path / ".latest-crashed.json").write_text("{")
    assert latest(tmp_path).step == 30
    assert sorted(p.name for p in tmp_path.iterdir() if p.name == LATEST) == [LATEST]


@pytest.mark.slow
def test_a_killed_worker_is_restarted_from_the_checkpoint(local_ray, sqlite_uri, tmp_path):
    killed = []

    def kill_rank1_at_step_15(reports, facts):
        if reports[0]["step"] == 15 and not killed:
            os.kill(facts[1]["pid"], signal.SIGKILL)  # a real kill -9 of the worker process
            killed.append(facts[1]["pid"])

    cfg = compose_config(*RUN, f"tracking.uri={sqlite_uri}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                         "train.max_failures=1", "tracking.run_name=killed")
    result = run_training(*to_typed(cfg), on_report=kill_rank1_at_step_15)
    steps = [r[0]["step"] for r in result.reports]
    # First attempt: 5, 10, 15 (killed after 15's report); second attempt resumes at 10.
    assert killed and steps == [5, 10, 15, 15, 20, 25, 30]
    first_15, replayed_15 = result.reports[2][0], result.reports[3][0]
    # Same weights, optimizer, scheduler, data position and RNG: the replayed interval computes
    # the same losses. Only the order of floating-point reductions could differ (it does not on
    # this 2-rank gloo group), hence a tolerance far below any real drift.
    assert replayed_15["loss"] == pytest.approx(first_15["loss"], abs=1e-4)
    assert result.worker_facts[1]["pid"] != killed[0] and result.worker_facts[0]["start_step"] == 10
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["restarts"] == "1" and run.data.tags["restart.1.resumed_from_step"] == "10"
    assert "ActorDiedError" in run.data.tags["restart.1.cause"] or "died" in run.data.tags["restart.1.cause"]
    assert [m.step for m in client.get_metric_history(result.run_id, "loss")] == [5, 10, 15, 20, 25, 30]
    assert latest(tmp_path / "ckpt").step == 30


@pytest.mark.slow
def test_resume_auto_continues_the_same_mlflow_run(local_ray, sqlite_uri, tmp_path):
    ckpt = f"train.checkpoint_dir={tmp_path / 'ckpt'}"
    first = run_training(*to_typed(compose_config(*RUN, "train.steps=10", ckpt, f"tracking.uri={sqlite_uri}")))
    second = run_training(*to_typed(compose_config(*RUN, "train.steps=20", ckpt, "train.resume=auto",
                                                   f"tracking.uri={sqlite_uri}")))
    assert second.run_id == first.run_id
    assert [r[0]["step"] for r in second.reports] == [15, 20]
    assert second.worker_facts[0]["start_step"] == 10
    # Training continued rather than restarted: the loss keeps falling from where it was.
    assert second.reports[0][0]["loss"] < first.reports[0][0]["loss"]
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [5, 10, 15, 20]
    assert client.get_run(first.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_a_hung_worker_is_detected_named_and_its_stacks_saved(local_ray, sqlite_uri):
    from launchers.worker_group import WorkerHangError

    cfg = compose_config(*RUN, "train.checkpoint_every=0", "model._target_=faulty_models.HangingGPT",
                         "train.hang_timeout_s=5", f"tracking.uri={sqlite_uri}", "tracking.run_name=hung")
    with pytest.raises(WorkerHangError) as info:
        run_training(*to_typed(cfg))
    assert info.value.ranks == [1]
    assert "stopped reporting: no optimizer step for 5s" in str(info.value)
    assert "time.sleep(3600)" in info.value.stacks[1]
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id],
                             filter_string="attributes.run_name = 'hung'")[0]
    assert run.info.status == "FAILED" and run.data.tags["hang.1.ranks"] == "1"
    saved = {a.path for a in client.list_artifacts(run.info.run_id, "hangs/attempt1")}
    assert saved == {"hangs/attempt1/rank0.txt", "hangs/attempt1/rank1.txt"}


@pytest.mark.slow
def test_tracking_falls_back_to_a_local_store_when_asked(local_ray, sqlite_uri, tmp_path, capsys):
    from conftest import free_port

    cfg = compose_config(*RUN, "train.steps=5", "train.checkpoint_every=0",
                         f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.fallback=local")
    result = run_training(*to_typed(cfg))
    assert "tracking in sqlite:///mlflow.db instead" in capsys.readouterr().err
    local = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert local.get_run(result.run_id).info.status == "FINISHED"
