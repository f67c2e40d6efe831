"""Resuming at another data-parallel degree: the rules in milliseconds, then a real run that
writes checkpoints at dp=2 to an S3 bucket and resumes at dp=1 through DeepSpeed's universal
checkpoint, converted by the driver and uploaded beside it."""

from __future__ import annotations

import io

import pytest

from helpers.config import FAST, compose_config
from helpers.ray_cluster import ray_with_env
from orch.config import to_typed
from orch.launchers.checkpoint import latest, layout_of, publish, resumed_position, tag_for
from orch.launchers.engines.deepspeed.universal import needs_universal
from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.spec import ClusterSpec, PlanSpec, TrainSpec


@pytest.fixture(scope="module")
def local_ray(s3_store):
    """The module's Ray, started where the store's variables are set: its workers inherit them,
    as the workers of a cluster node started with them do."""
    with ray_with_env(s3_store["env"]):
        yield


def plan(**kw):
    devices = kw.pop("devices", 2)
    return resolve_plan(PlanSpec(**kw), ClusterSpec(devices_per_node=devices), TrainSpec())


def test_only_a_dp_change_needs_a_universal_checkpoint():
    written = layout_of(plan(dp=2, zero_stage=1))
    assert not needs_universal(written, plan(dp=2, zero_stage=1))
    assert not needs_universal(None, plan(dp=2))  # a checkpoint from before layouts were recorded
    assert needs_universal(written, plan(dp=1, zero_stage=1, devices=1))
    # tp and pp cannot change on resume; the message says what the checkpoint has.
    with pytest.raises(PlanError) as info:
        needs_universal(written, plan(dp=1, tp=2, zero_stage=1))
    assert info.value.violations[0].field == "plan.tp"
    assert "written with tp=1" in info.value.violations[0].message


def test_a_dp_change_needs_zero_optimizer_states_on_both_sides():
    with pytest.raises(PlanError, match=r"from a checkpoint written at dp=2 needs a universal checkpoint"):
        needs_universal(layout_of(plan(dp=2, zero_stage=0)), plan(dp=1, zero_stage=1, devices=1))
    with pytest.raises(PlanError, match=r"this plan has ZeRO stage 0"):
        needs_universal(layout_of(plan(dp=2, zero_stage=1)), plan(dp=1, zero_stage=0, devices=1))


def test_the_data_position_follows_the_samples_consumed():
    saved = {"dp": 2, "micro_batch_size": 4}
    # 10 batches of 4 on each of 2 ranks: the first 80 samples of the order.
    assert resumed_position(10, saved, micro_batch_size=4, dp=1) == 20
    assert resumed_position(10, saved, micro_batch_size=8, dp=4) == 2  # 80 // 32: re-reads 16, skips none


def test_latest_json_records_the_layout(tmp_path):
    layout = layout_of(plan(dp=2, zero_stage=1))
    (tmp_path / tag_for(5)).mkdir()
    publish(tmp_path, 5, None, keep=2, layout=layout)
    assert latest(tmp_path).layout == layout


@pytest.mark.slow
def test_resume_at_another_dp_from_s3_continues_the_same_curve(dp_reference, local_ray, s3_store, sqlite_uri, tmp_path):
    from orch.run.driver import run_training

    def train(*overrides, stream=None):
        return run_training(*to_typed(compose_config(*FAST, f"tracking.uri={sqlite_uri}", "plan.zero_stage=1",
                                                     *overrides)), stream=stream)

    whole = dp_reference  # dp=2, 30 steps, ZeRO-1, uninterrupted
    checkpoints = ["train.checkpoint_every=10", f"train.checkpoint_dir=s3://{s3_store['bucket']}/universal",
                   "train.resume=auto"]
    # The first 10 steps of the same run: its 10 warmup steps end at the checkpoint, so its
    # learning rates are the 30-step run's up to there.
    first = train(*checkpoints, "plan.dp=2", "train.steps=10")
    # The same global batch (4 x 2 accumulation on one worker) and data order: after the
    # conversion the run should take exactly the steps the dp=2 run took, up to summation order.
    out = io.StringIO()
    resumed = train(*checkpoints, "plan.dp=1", "cluster.devices_per_node=1", "plan.grad_accum_steps=2", stream=out)
    assert "written with dp=2; converting it to a universal checkpoint for dp=1" in out.getvalue()
    assert resumed.run_id == first.run_id
    assert resumed.worker_facts[0].start_step == 10
    # One MLflow run holds both commands' steps, finished by the second.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [5, 10, 15, 20, 25, 30]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    # Pruning step 10 (keep_checkpoints=2 after steps 20 and 30) removed its conversion too.
    listed = s3_store["client"].list_objects_v2(Bucket=s3_store["bucket"], Prefix="universal/")["Contents"]
    # (pyarrow marks the directories it creates with empty objects named like them: "universal/".)
    assert {o["Key"].split("/")[1] for o in listed} - {""} == {"latest.json", "step_000000020", "step_000000030"}
    assert [r[0].step for r in resumed.reports] == [15, 20, 25, 30]
    assert [r[0].loss for r in resumed.reports] == pytest.approx([r[0].loss for r in whole.reports[2:]],
                                                                    abs=1e-4)
    # `orch export` consolidates the newest checkpoint from the bucket.
    from orch.export import export_run

    assert export_run(sqlite_uri, resumed.run_id, to_typed(compose_config())[1], tmp_path / "out") == "step_000000030"
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0
