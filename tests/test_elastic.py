"""An elastic run's rules and its re-plan, without Ray: what it needs declared, the shape of the cluster
that survives a loss, the global batches it may move to, which checkpoints resume which plans, the
search for the survivors' plan and how the re-plan is told. A real node lost mid-run on a two-node Ray
cluster, and the run scaling back up, are in tests/test_cluster.py."""

from __future__ import annotations

import dataclasses
import io

import pytest

from helpers.config import compose_config
from orch.config import to_typed
from orch.declared import declared_violations
from orch.launchers.job import StepReport
from orch.plans.elastic import batch_sizes_to_try, surviving_shape, surviving_shapes
from orch.plans.engines import engine_spec
from orch.plans.spec import ClusterSpec, PlanSpec
from orch.tracking.goodput import GoodputLedger

ELASTIC = ["train.elastic.enabled=true", "train.checkpoint_every=10", "train.max_failures=2",
           "plan.zero_stage=1", "train.checkpoint_dir=/tmp/orch-elastic-test"]
MLP = ["model=mlp", "data=dataset", "objective=classification"]


def violations(*overrides: str) -> dict[str, str]:
    typed, _, _ = to_typed(compose_config(*overrides))
    return {v.field: f"{v.message} Fix: {v.fix}" for v in declared_violations(typed)}


def test_an_elastic_run_needs_checkpoints_a_restart_and_checkpoints_that_reshard():
    assert violations(*ELASTIC) == {}
    assert violations("train.elastic.enabled=false") == {}  # off by default, and nothing asked of it then
    assert "set train.elastic.enabled=true as well" in violations("train.elastic.exclude_stragglers=true")[
        "train.elastic.exclude_stragglers"]
    found = violations("train.elastic.enabled=true", "plan.zero_stage=0")
    assert set(found) == {"train.checkpoint_every", "train.max_failures", "plan.zero_stage"}
    assert "resumes the survivors from the run's last checkpoint" in found["train.checkpoint_every"]
    assert "set train.max_failures" in found["train.max_failures"]
    assert "universal checkpoint" in found["plan.zero_stage"] and "set plan.zero_stage=1" in found["plan.zero_stage"]
    # FSDP2's checkpoints (DCP) reshard at any stage setting.
    assert violations(*ELASTIC[:3], "plan.engine=fsdp2", "train.checkpoint_dir=/tmp/x") == {}
    found = violations(*ELASTIC, "train.elastic.batch_tolerance=1", "train.elastic.min_devices=0",
                       "train.elastic.wait_s=-1", "train.elastic.replan_timeout_s=0")
    assert set(found) == {"train.elastic.batch_tolerance", "train.elastic.min_devices", "train.elastic.wait_s",
                          "train.elastic.replan_timeout_s"}
    assert found["train.elastic.batch_tolerance"].startswith("must be in [0, 1)")
    assert "train.elastic.batch_tolerance=0" in found["train.elastic.batch_tolerance"]


@pytest.mark.parametrize(("slots", "shape"), [
    ([2, 0], (1, 2)),  # a node lost: the other's two devices
    ([2, 1], (1, 2)),  # one device lost: one node of two, or two of one; tensor groups stay inside nodes
    ([1, 1], (2, 1)),
    ([2, 2, 2], (2, 2)),  # never more nodes than declared
    ([4, 4], (2, 2)),  # nor more devices per node
    ([], (0, 0)),
])
def test_the_survivors_are_the_largest_uniform_shape_of_the_live_nodes(slots, shape):
    assert surviving_shape(slots, ClusterSpec(nodes=2, devices_per_node=2)) == shape


def test_every_shape_the_survivors_hold_is_tried_largest_first():
    # 4 nodes of 8 GPUs, one GPU lost: 4 x 7 holds the most devices, but tp=8 needs 8 on a node;
    # 3 x 8 and 4 x 6 hold as many, and more on a node comes first.
    shapes = surviving_shapes([8, 8, 7, 8], ClusterSpec(nodes=4, devices_per_node=8))
    assert shapes[:3] == [(4, 7), (3, 8), (4, 6)] and shapes[-1] == (4, 1) and len(shapes) == 8


def test_the_global_batch_moves_only_within_the_tolerance_closest_first():
    assert batch_sizes_to_try(8, 0.0, 2) == [8]
    assert batch_sizes_to_try(3, 0.0, 2) == [3]  # which no plan of 2 devices trains: the search says so
    assert batch_sizes_to_try(3, 0.34, 2) == [3, 2, 4]
    assert batch_sizes_to_try(12, 0.1, 8) == [12]  # 8 and 16 are 33% away
    assert batch_sizes_to_try(12, 0.34, 8) == [12, 8, 16]


def test_a_checkpoint_resumes_the_plans_its_engine_can_reshard_it_into():
    deepspeed, fsdp2 = engine_spec("deepspeed"), engine_spec("fsdp2")
    saved = {"engine": "deepspeed", "dp": 4, "tp": 1, "pp": 1, "zero_stage": 1}
    assert deepspeed.resume_problem(saved, PlanSpec(dp=2, zero_stage=1)) is None
    assert "same tp" in deepspeed.resume_problem(saved, PlanSpec(dp=1, tp=2, zero_stage=1))
    assert "same zero_stage" in deepspeed.resume_problem(saved, PlanSpec(dp=2, zero_stage=2))
    assert "ZeRO-0" in deepspeed.resume_problem({**saved, "zero_stage": 0}, PlanSpec(dp=2, zero_stage=0))
    assert deepspeed.resume_problem({**saved, "zero_stage": 0}, PlanSpec(dp=4, zero_stage=0)) is None
    assert fsdp2.resume_problem({"dp": 4, "tp": 1, "pp": 1}, PlanSpec(engine="fsdp2", dp=1, tp=2)) is None
    assert deepspeed.resume_problem({}, PlanSpec(dp=2, tp=2)) is None  # nothing saved yet: any plan


def elastic_run(*overrides: str):
    """An :class:`ElasticRun` of the MLP on a declared cluster, its declared job prepared (no Ray)."""
    from orch.run.elastic import ElasticRun
    from orch.run.prepare import prepare_job

    cfg, model_cfg, _ = to_typed(compose_config(*MLP, *ELASTIC, *overrides))
    declared = prepare_job(cfg, model_cfg, cfg.cluster)
    return ElasticRun(cfg=cfg, model_cfg=model_cfg, cluster=cfg.cluster, declared=declared)


def test_the_replan_keeps_the_global_batch_engine_and_settings_among_plans_the_checkpoint_resumes():
    from orch.launchers.checkpoint import Published, layout_of

    run = elastic_run("cluster.nodes=2", "cluster.devices_per_node=2", "plan.dp=4", "plan.micro_batch_size=2",
                      "plan.grad_accum_steps=3")
    survivors = dataclasses.replace(run.cluster, nodes=1)
    published = Published(tag="step_000000010", step=10, run_id=None, layout=layout_of(run.declared.plan))
    cfg = run._search(run.declared, [survivors], published)
    assert cfg.cluster == survivors and cfg.train.global_batch_size == 24 == run.declared.plan.global_batch_size
    assert (cfg.plan.dp, cfg.plan.tp, cfg.plan.engine, cfg.plan.zero_stage) == (2, 1, "deepspeed", 1)
    assert cfg.plan.micro_batch_size * cfg.plan.grad_accum_steps == 12


def test_a_batch_the_survivors_cannot_hold_moves_within_the_tolerance_or_the_run_stops_saying_why():
    from orch.run.elastic import ElasticError

    run = elastic_run("cluster.devices_per_node=3", "plan.dp=3", "plan.micro_batch_size=1")
    survivors = dataclasses.replace(run.cluster, devices_per_node=2)
    with pytest.raises(ElasticError, match=r"global batch 3 \(train.elastic.batch_tolerance=0\)") as refused:
        run._search(run.declared, [survivors], None)
    assert "raise train.elastic.batch_tolerance" in str(refused.value) and "(1x2: nodes x devices)" in str(
        refused.value)
    run.cfg.train.elastic.batch_tolerance = 0.34
    cfg = run._search(run.declared, [survivors], None)
    assert cfg.train.global_batch_size == 2 and cfg.plan.dp == 2  # 2 and 4 are as close: the smaller first


def test_a_replan_is_told_with_what_changed_and_kept_in_the_run():
    from orch.run.elastic import ElasticRun

    run = elastic_run("cluster.nodes=2", "cluster.devices_per_node=2", "plan.dp=4", "plan.micro_batch_size=2")
    survivors = dataclasses.replace(run.cluster, nodes=1)
    cfg = run._search(run.declared, [survivors], None)
    from orch.run.prepare import prepare_job

    replanned = prepare_job(cfg, run.model_cfg, survivors, workload=run.declared.workload)
    out = io.StringIO()
    replan = ElasticRun._record(run, run.declared, replanned, "2 of 4 devices lost: ActorDiedError", None, 0.0,
                                steps_done=0, tracker=None, out=out)
    text = out.getvalue()
    assert text.startswith("re-plan 1 (2 of 4 devices lost: ActorDiedError): 4 -> 2 devices (dp 4 -> 2, ")
    assert "global batch 8; predicted " in text and "resuming from step 0" in text
    assert replan.as_dict()["new_layout"]["dp"] == 2 and replan.eta_s == pytest.approx(
        replan.predicted_step_s * run.cfg.train.steps)
    assert run.replans == [replan]


def test_a_replans_seconds_are_its_own_in_goodput_and_a_stopped_attempt_is_no_failure():
    report = [StepReport(rank=0, step=5, loss=1.0, local_loss=1.0, lr=1e-3, step_time_s=1.0, samples_per_s=1.0,
                         tokens_per_s=None, epoch=0, first_batch_digest="", steps=5)]
    ledger = GoodputLedger(started=0.0)
    ledger.attempt_started(now=0.0)
    ledger.reported(report, redone=False, now=10.0)
    ledger.attempt_failed("ActorDiedError", now=12.0)
    ledger.replanned(6.0)
    ledger.attempt_started(now=20.0)
    ledger.reported(report, redone=False, now=30.0)
    ledger.attempt_stopped("scale-up", now=30.0)
    ledger.replanned(3.0)
    ledger.attempt_started(now=35.0)
    total = ledger.totals(now=40.0)
    # 2 s lost after the first attempt's last report, 6 s re-planning, 2 s more before the next group.
    assert total["replan"] == pytest.approx(9.0) and total["restart"] == pytest.approx(2.0 + 2.0 + 2.0)
    assert sum(v for k, v in total.items() if k not in ("wall", "goodput")) == pytest.approx(40.0)
    attempts = ledger.as_dict(now=40.0)["attempts"]
    assert [(a["failed"], a["stopped"]) for a in attempts] == [("ActorDiedError", None), (None, "scale-up"),
                                                                (None, None)]


def test_a_smaller_shape_is_taken_when_the_largest_cannot_resume_the_checkpoints_layout():
    """A DeepSpeed checkpoint at tp=2 resumes only at tp=2: 3 surviving devices of a node cannot hold
    it, 2 can."""
    from orch.launchers.checkpoint import Published, layout_of

    run = elastic_run("model=gpt", "data=corpus", "objective=causal_lm", "cluster.devices_per_node=4", "plan.dp=2",
                      "plan.tp=2", "plan.micro_batch_size=4")
    published = Published(tag="step_000000010", step=10, run_id=None, layout=layout_of(run.declared.plan))
    shapes = [dataclasses.replace(run.cluster, devices_per_node=n) for n in (3, 2)]
    cfg = run._search(run.declared, shapes, published)
    assert cfg.cluster.devices_per_node == 2 and (cfg.plan.dp, cfg.plan.tp) == (1, 2)
    assert cfg.plan.micro_batch_size * cfg.plan.grad_accum_steps == 8
