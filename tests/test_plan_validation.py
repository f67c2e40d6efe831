"""Plan validation is pure: every rule is checked without Ray, DeepSpeed or a device."""

from __future__ import annotations

import pytest

from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Accelerator, ClusterSpec, Offload, PlanSpec, Precision, TrainSpec


def fields(error: PlanError) -> list[str]:
    return [v.field for v in error.violations]


def test_default_plan_fills_the_cluster_with_data_parallel_ranks():
    plan = resolve_plan(PlanSpec(), ClusterSpec(nodes=2, devices_per_node=4), TrainSpec())
    assert (plan.dp, plan.tp, plan.pp, plan.world_size) == (8, 1, 1, 8)
    assert plan.global_batch_size == 4 * 8


def test_every_problem_is_reported_at_once_with_field_value_and_fix():
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(zero_stage=5, dp=3, tp=3, precision=Precision.fp16), ClusterSpec(), TrainSpec())
    error = info.value
    assert fields(error) == ["plan.tp", "plan.dp", "plan.zero_stage", "plan.precision"]
    text = str(error)
    assert "plan.zero_stage=5: ZeRO stages are 0, 1, 2 and 3." in text
    assert "dp(3) * tp(3) * pp(1) = 9 != world size 2 (cluster.nodes=1 * cluster.devices_per_node=2)" in text
    assert all(v.fix for v in error.violations)


def test_dp_that_does_not_match_the_workers_names_the_arithmetic():
    with pytest.raises(PlanError, match=r"plan.dp=3: dp\(3\) \* tp\(1\) \* pp\(1\) = 3 != world size 2") as info:
        resolve_plan(PlanSpec(dp=3), ClusterSpec(), TrainSpec())
    assert "set plan.dp=2" in info.value.violations[0].fix


def test_pipeline_plan_resolves_with_dp_filling_the_rest():
    plan = resolve_plan(PlanSpec(pp=2, tp=2, zero_stage=1), ClusterSpec(nodes=2, devices_per_node=4), TrainSpec())
    assert (plan.dp, plan.tp, plan.pp, plan.world_size) == (2, 2, 2, 8)
    # Micro-batches flow through the stages: only dp multiplies the batch.
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum_steps * 2


def test_tensor_parallel_plan_resolves_with_dp_filling_the_rest():
    plan = resolve_plan(PlanSpec(tp=2), ClusterSpec(nodes=2, devices_per_node=4), TrainSpec())
    assert (plan.dp, plan.tp, plan.world_size) == (4, 2, 8)
    # The ranks of a tensor-parallel group share one batch: only dp multiplies it.
    assert plan.global_batch_size == 4 * 4
    assert resolve_plan(PlanSpec(tp=2, dp=1), ClusterSpec(), TrainSpec()).dp == 1


def test_a_tensor_parallel_group_must_sit_inside_one_node():
    # 2 nodes of 3 devices: tp=2 divides the world (6) but would split a group across nodes.
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(tp=2), ClusterSpec(nodes=2, devices_per_node=3), TrainSpec())
    assert fields(info.value) == ["plan.tp"]
    violation = info.value.violations[0]
    assert str(violation) == ("plan.tp=2: a tensor-parallel group must sit inside one node, but tp(2) does not "
                              "divide cluster.devices_per_node(3) (3 % 2 = 1). "
                              "Fix: set plan.tp to a divisor of 3: 1, 3")


def test_tensor_parallelism_refuses_zero_stage_3_naming_the_stage():
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(tp=2, dp=1, zero_stage=3), ClusterSpec(), TrainSpec())
    assert fields(info.value) == ["plan.zero_stage"]
    assert str(info.value.violations[0]) == (
        "plan.zero_stage=3: DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO stages 0, 1, 2 only, "
        "not stage 3 (plan.tp=2). Fix: set plan.zero_stage=2, or plan.tp=1 to keep ZeRO-3")
    for stage in (0, 1, 2):
        assert resolve_plan(PlanSpec(tp=2, dp=1, zero_stage=stage), ClusterSpec(), TrainSpec()).zero_stage == stage
    # ZeRO-3 without tensor parallelism stays fine.
    assert resolve_plan(PlanSpec(zero_stage=3), ClusterSpec(), TrainSpec()).zero_stage == 3


def test_offload_rules():
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(zero_stage=0, offload_optimizer=Offload.cpu, offload_param=Offload.nvme),
                     ClusterSpec(), TrainSpec())
    assert fields(info.value) == ["plan.offload_param", "plan.offload_optimizer", "plan.nvme_path"]
    plan = resolve_plan(PlanSpec(zero_stage=3, offload_optimizer=Offload.nvme, offload_param=Offload.cpu,
                                 nvme_path="/nvme"), ClusterSpec(), TrainSpec())
    assert plan.offload_optimizer == Offload.nvme


def test_fp16_is_refused_on_cpu_but_planned_for_gpus():
    with pytest.raises(PlanError, match="plan.precision='fp16': DeepSpeed does not support fp16 training on CPU"):
        resolve_plan(PlanSpec(precision=Precision.fp16), ClusterSpec(), TrainSpec())
    gpu = ClusterSpec(accelerator=Accelerator.gpu, devices_per_node=8)
    assert resolve_plan(PlanSpec(precision=Precision.fp16), gpu, TrainSpec()).precision == Precision.fp16


def test_global_batch_must_be_reachable_and_the_fix_computes_accumulation():
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(micro_batch_size=4), ClusterSpec(), TrainSpec(global_batch_size=32))
    assert info.value.violations[0].fix == "set plan.grad_accum_steps=4"
    with pytest.raises(PlanError, match="micro_batch_size\\(4\\) \\* grad_accum_steps\\(1\\) \\* dp\\(2\\) = 8"):
        resolve_plan(PlanSpec(micro_batch_size=4), ClusterSpec(), TrainSpec(global_batch_size=30))
    ok = resolve_plan(PlanSpec(micro_batch_size=4, grad_accum_steps=4), ClusterSpec(), TrainSpec(global_batch_size=32))
    assert ok.global_batch_size == 32


def test_non_positive_sizes_are_rejected():
    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(micro_batch_size=0, grad_accum_steps=-1), ClusterSpec(devices_per_node=0),
                     TrainSpec(steps=0))
    assert {"plan.micro_batch_size", "plan.grad_accum_steps", "cluster.devices_per_node", "train.steps"} <= set(
        fields(info.value))


def test_plan_error_survives_pickling_across_processes():
    import pickle

    with pytest.raises(PlanError) as info:
        resolve_plan(PlanSpec(zero_stage=7), ClusterSpec(), TrainSpec())
    clone = pickle.loads(pickle.dumps(info.value))
    assert fields(clone) == ["plan.zero_stage"] and str(clone) == str(info.value)
