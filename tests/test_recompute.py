"""Recomputation as a policy (``plan.activation_checkpointing``: none, selective, full): how it is
spelled and refused, what the planner and the tuner make of each. Pure: meta tensors, no workers
(the three policies train to the same losses in tests/test_train_e2e.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helpers.config import compose_config, lm_inputs
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.memory.activations import saved_activation_bytes
from orch.plans.model.workload import enable_activation_checkpointing, selective_problem
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Recompute
from orch.workloads.gpt import GPT

GPT_SHAPE = dict(n_layer=2, d_model=64, n_head=4, seq_len=32, vocab_size=128)


@pytest.mark.parametrize(("given", "policy"), [
    (False, Recompute.none), (True, Recompute.full), ("false", Recompute.none), ("True", Recompute.full),
    ("selective", Recompute.selective), ("FULL", Recompute.full), (Recompute.none, Recompute.none)])
def test_true_and_false_keep_meaning_full_and_none(given, policy):
    assert Recompute.of(given) is policy
    assert bool(policy) is (policy is not Recompute.none)


def test_a_plan_spells_its_policy_and_an_unknown_one_is_refused_with_the_field_and_the_fix():
    typed, _, _ = to_typed(compose_config("plan.activation_checkpointing=selective"))
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    assert plan.activation_checkpointing is Recompute.selective
    assert "activation_checkpointing=selective" in plan.layout_text()
    assert plan.as_dict()["activation_checkpointing"] == "selective"
    typed, _, _ = to_typed(compose_config("plan.activation_checkpointing=true"))
    assert resolve_plan(typed.plan, typed.cluster, typed.train).activation_checkpointing is Recompute.full
    typed, _, _ = to_typed(compose_config("plan.activation_checkpointing=sometimes"))
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = refused.value.violations
    assert (violation.field, violation.value) == ("plan.activation_checkpointing", "sometimes")
    assert "none, selective or full" in violation.fix


def test_selective_keeps_the_matmul_outputs_full_keeps_only_the_block_inputs():
    def saved(policy) -> int:
        return saved_activation_bytes(partial(GPT, **GPT_SHAPE), micro_batch_size=2,
                                      inputs=lm_inputs(GPT_SHAPE["seq_len"]), dtype=torch.float32,
                                      checkpointing=policy)

    none, selective, full = saved(Recompute.none), saved(Recompute.selective), saved(Recompute.full)
    assert none > selective > full
    assert saved(True) == full and saved(False) == none


def test_selective_recomputes_no_matmul_and_full_recomputes_the_forward():
    """FLOPs counted as the planner counts them: selective's are none's (the matmuls are kept),
    full's add the blocks' forward again."""
    from orch.plans.step_time.flops import training_flops_per_sample

    inputs = lm_inputs(GPT_SHAPE["seq_len"])
    flops = {policy: training_flops_per_sample(partial(GPT, **GPT_SHAPE), inputs, checkpointing=policy)
             for policy in Recompute}
    assert flops[Recompute.selective] == flops[Recompute.none] < flops[Recompute.full]


def test_a_model_whose_own_switch_takes_no_arguments_cannot_recompute_selectively():
    class OwnSwitch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def gradient_checkpointing_enable(self):
            pass

    problem = selective_problem(OwnSwitch())
    assert "takes no checkpoint arguments" in problem
    assert selective_problem(GPT(**GPT_SHAPE)) is None
    with pytest.raises(ValueError, match="takes no checkpoint arguments"):
        enable_activation_checkpointing(OwnSwitch(), Recompute.selective)


def test_the_tuner_tries_every_policy_and_a_plan_that_does_not_fit_is_told_selective_first():
    from orch.plans.engines import engine_spec

    typed, _, _ = to_typed(compose_config())
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    assert [change["activation_checkpointing"] for _, change in engine_spec(plan.engine).fixes(plan)
            if "activation_checkpointing" in change] == [Recompute.selective, Recompute.full]
    assert [Recompute.of(v) for v in typed.tune.activation_checkpointing] == list(Recompute)
    typed, _, _ = to_typed(compose_config("tune.activation_checkpointing=[false,maybe]"))
    from orch.tune.search import _space

    with pytest.raises(PlanError, match="tune.activation_checkpointing"):
        _space(typed, 2, True)
    typed, _, _ = to_typed(compose_config("tune.activation_checkpointing=[none,selective,true]"))
    assert _space(typed, 2, True).activation_checkpointing == tuple(Recompute)
    assert _space(typed, 2, True, "no arguments").activation_checkpointing == (Recompute.none, Recompute.full)
    assert _space(typed, 2, False).activation_checkpointing == (Recompute.none,)


def test_deepspeed_refuses_selective_recomputation_with_autotp_which_reduces_in_place():
    """AutoTP all-reduces a row-parallel output in place; selective recomputation keeps that output and
    would reduce it again in backward (measured: the losses drift from the run without recomputation,
    while full recomputation and FSDP2's DTensor tensor parallelism match it)."""
    typed, _, _ = to_typed(compose_config("plan.tp=2", "plan.zero_stage=1", "plan.activation_checkpointing=selective"))
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = refused.value.violations
    assert violation.field == "plan.activation_checkpointing" and "reduce it a second time" in violation.message
    assert violation.fix.startswith("set plan.activation_checkpointing=full")
    for allowed in (["plan.tp=2", "plan.zero_stage=1", "plan.activation_checkpointing=full"],
                    ["plan.activation_checkpointing=selective"]):
        typed, _, _ = to_typed(compose_config(*allowed))
        resolve_plan(typed.plan, typed.cluster, typed.train)
