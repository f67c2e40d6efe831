"""``plan.async_tp``: the rules, the cost model's overlap, the tuner's axis, and the engine's
compiled blocks running the fused collective-matmul ops on a 2-rank gloo group."""

from __future__ import annotations

import json

import pytest

from helpers.config import compose_config
from helpers.processes import free_port
from orch.checking import checked_run
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.step_time.prediction import declared_plan_step

HF_TP = ("model=hf_causal_lm", "plan.engine=fsdp2", "plan.tp=2", "plan.dp=1")
ASYNC = (*HF_TP, "plan.sequence_parallel=true", "plan.compile=true", "plan.async_tp=true")
GPU = "cluster.accelerator=gpu"


def _typed(*overrides: str):
    return to_typed(compose_config(*overrides))[0]


def test_a_compiled_sequence_parallel_plan_on_gpus_overlaps_its_collectives():
    typed = _typed(*ASYNC, GPU)
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    assert plan.async_tp and plan.layout_text().endswith("sequence_parallel=true async_tp=true")
    assert plan.as_dict()["async_tp"] is True
    from orch.checking import step_assumptions

    assert step_assumptions(plan, typed.cluster) == [
        "each block compiled (its memory-bound kernels fused as inductor fuses them)",
        "async TP (the tensor-parallel collectives overlapped with their matmuls, run in 2 chunks)"]


@pytest.mark.parametrize(("overrides", "message", "fix"), [
    ((GPU, "plan.engine=deepspeed", "plan.zero_stage=1"),
     "the deepspeed engine runs each tensor-parallel collective on its own; async TP runs in the fsdp2 engine",
     "set plan.engine=fsdp2"),
    ((GPU, "plan.tp=1", "plan.dp=2"), "and plan.tp=1", "set plan.tp to 2 or more"),
    ((GPU, "plan.sequence_parallel=false"), "which sequence parallelism runs, and plan.sequence_parallel=false",
     "set plan.sequence_parallel=true"),
    ((GPU, "plan.compile=false"), "a pass of torch.compile", "set plan.compile=true"),
    ((), "symmetric memory shared by the GPUs of a node (CUDA), and cluster.accelerator=cpu",
     "set plan.async_tp=false"),
])
def test_plans_that_cannot_overlap_are_refused_with_the_field_and_the_fix(overrides, message, fix):
    typed = _typed(*ASYNC, *overrides)
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = [v for v in refused.value.violations if v.field == "plan.async_tp"]
    assert message in violation.message and violation.fix.startswith(fix)


def _step(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*ASYNC, GPU, "plan.grad_accum_steps=2", *overrides))
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    return declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)


def test_the_cost_model_leaves_a_chunk_of_the_traffic_exposed_and_prices_chunked_matmuls():
    """1/tp of the tensor-parallel traffic stays exposed, and the rest wherever it outlasts the
    matmuls; the matmuls run in tp chunks of their rows, never faster than whole."""
    plain, overlapped = _step("plan.async_tp=false"), _step()
    assert 0 < overlapped.tp_comm_s < plain.tp_comm_s
    assert overlapped.tp_comm_s == pytest.approx(
        plain.tp_comm_s / 2 + max(0.0, plain.tp_comm_s / 2 - overlapped.compute_s))
    assert overlapped.compute_s >= plain.compute_s
    assert (overlapped.memory_s, overlapped.dp_comm_s) == (plain.memory_s, plain.dp_comm_s)


def test_the_tuner_overlaps_where_an_engine_can_and_only_on_gpus():
    from orch.tune.search import _space, prepare

    typed = _typed("tune.engines=[deepspeed,fsdp2]", "tune.zero_stages=[1]")
    assert list(typed.tune.async_tp) == [False, True]
    plans = list(_space(typed, 4, True).plans())
    overlapped = [p for p in plans if p.async_tp]
    assert overlapped and all(p.engine == "fsdp2" and p.tp > 1 and p.sequence_parallel and p.compile
                              for p in overlapped)
    assert any(p.tp > 1 and p.compile and p.sequence_parallel and not p.async_tp for p in plans)
    space, _ = prepare(typed, to_typed(compose_config())[1], typed.cluster)
    assert space.async_tp == (False,)  # CPU workers have no symmetric memory


def _ranks(scenario: str, out, **kwargs) -> dict:
    """One 2-rank run of a scenario of tests/helpers/fsdp2_ranks.py (a process group per run)."""
    from helpers.fsdp2_ranks import spawn

    out.mkdir()
    spawn(scenario, 2, out, free_port(), **kwargs)
    return json.loads((out / f"{scenario}.json").read_text())


@pytest.mark.slow
def test_the_compiled_blocks_run_the_fused_ops_and_train_as_the_eager_model(tmp_path):
    """On a 2-rank gloo group, with torch's fallbacks standing in for the CUDA kernels: the pass
    finds the sequence-parallel all-gathers and reduce-scatters around the Llama's tensor-parallel
    matmuls, and the losses are the eager run's."""
    eager = _ranks("async_tp", tmp_path / "eager", overlapped=False)
    overlapped = _ranks("async_tp", tmp_path / "overlapped", overlapped=True)
    assert eager["calls"] == {}
    # Per block and step: the all-gathers in front of q/k/v and gate/up, forward, and of the
    # gradients into o_proj and down_proj, backward; the reduce-scatters after o_proj and down_proj.
    assert overlapped["calls"] == {"fused_all_gather_matmul": 2 * 4 * 4, "fused_matmul_reduce_scatter": 2 * 2 * 4}
    assert overlapped["built"].endswith("its collectives overlapped with their matmuls (async TP), the output head "
                                        "split over the vocabulary (loss parallel, lm_head)")
    assert overlapped["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert overlapped["losses"][-1] < overlapped["losses"][0]
