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


# --- every n-th block (plan.recompute_every_n_layers) ---------------------------------------------

DEEPER = dict(GPT_SHAPE, n_layer=4)


def _every(n: int, policy: str = "full"):
    """The GPT of ``DEEPER`` on meta with blocks 0, n, 2n, ... checkpointed."""
    def build():
        module = GPT(**DEEPER)
        enable_activation_checkpointing(module, policy, n)
        return module
    return build


def test_every_nth_block_recomputes_its_share_of_the_forward_and_saves_its_share_of_the_bytes():
    """Blocks 0 and 2 of 4 checkpointed: half the recomputed forward's FLOPs, and the saved bytes
    halfway between none's and full's, which is what the planner interpolates
    (orch.plans.memory.activations.partly_checkpointed) instead of measuring each n."""
    from orch.plans.memory.activations import measure_activations, partly_checkpointed
    from orch.plans.step_time.flops import training_flops_per_sample

    inputs = lm_inputs(DEEPER["seq_len"])
    flops = {n: training_flops_per_sample(partial(GPT, **DEEPER), inputs, checkpointing="full", every_n_layers=n)
             for n in (1, 2, 4)}
    none = training_flops_per_sample(partial(GPT, **DEEPER), inputs)
    assert flops[2] - none == (flops[1] - none) // 2 and flops[4] - none == (flops[1] - none) // 4

    def measured(factory, checkpointing):
        return measure_activations(factory, micro_batch_size=2, inputs=inputs, dtype=torch.float32,
                                   checkpointing=checkpointing)

    plain, full = measured(partial(GPT, **DEEPER), Recompute.none), measured(partial(GPT, **DEEPER), Recompute.full)
    every_2 = measured(_every(2), Recompute.none)  # checkpointed in the model itself: measured as it runs
    interpolated = partly_checkpointed(plain, full, 0.5)
    assert plain.saved > every_2.saved > full.saved
    assert interpolated.saved == pytest.approx(every_2.saved, rel=0.01)
    # The peaks come out above the measured ones (by 5-25% for these shapes): the interpolation
    # errs toward refusing a plan, never toward one that runs out of memory.
    for peak in ("forward_peak", "backward_peak", "backward_peak_with_grads", "blocks_backward_peak"):
        assert getattr(every_2, peak) <= getattr(interpolated, peak) <= 1.3 * getattr(every_2, peak), peak


def test_the_models_own_switch_and_the_generic_wrapping_pick_the_same_blocks():
    gpt = GPT(**DEEPER)
    enable_activation_checkpointing(gpt, "full", 3)
    assert gpt.checkpoint_every_n_layers == 3

    class NoSwitch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(5))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    plain = NoSwitch()
    enable_activation_checkpointing(plain, "full", 2)
    wrapped = [type(block.forward).__name__ == "_Checkpointed" for block in plain.blocks]
    assert wrapped == [True, False, True, False, True]
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(config)
    enable_activation_checkpointing(llama, "full", 2)
    flags = [layer.gradient_checkpointing for layer in llama.model.layers]
    if not any(type(layer.forward).__name__ == "_Checkpointed" for layer in llama.model.layers):
        assert flags == [True, False, True, False]  # Hugging Face's own every_n_layers


def test_every_n_is_spelled_refused_where_it_means_nothing_and_priced_between_none_and_full():
    from orch.plans.memory.estimate import estimate_plan
    from orch.plans.model.workload import Workload
    from orch.plans.step_time.prediction import declared_plan_step

    def resolved(*overrides):
        typed, model_cfg, _ = to_typed(compose_config(*overrides))
        return typed, model_cfg, resolve_plan(typed.plan, typed.cluster, typed.train)

    _, _, plan = resolved("plan.activation_checkpointing=full", "plan.recompute_every_n_layers=2")
    assert plan.recompute_every_n_layers == 2 and "recompute_every_n_layers=2" in plan.layout_text()
    assert plan.recomputed_share(4) == 0.5 and plan.recomputed_share(3) == pytest.approx(2 / 3)
    for overrides, field in [(["plan.recompute_every_n_layers=0"], "plan.recompute_every_n_layers"),
                             (["plan.recompute_every_n_layers=2"], "plan.recompute_every_n_layers"),
                             (["plan.activation_checkpointing=full", "plan.recompute_every_n_layers=2", "plan.pp=2",
                               "plan.dp=1"], "plan.recompute_every_n_layers")]:
        with pytest.raises(PlanError) as refused:
            resolved(*overrides)
        assert field in [v.field for v in refused.value.violations], overrides
    fsdp2 = resolved("plan.engine=fsdp2", "plan.activation_checkpointing=full", "plan.recompute_every_n_layers=2",
                     "plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=2", "model.n_layer=4")[2]
    assert fsdp2.recomputed_share(4) == 0.5  # two blocks a rank: the first of each rank's two
    assert fsdp2.recomputed_share(6) == pytest.approx(2 / 3)  # three a rank: its first and third

    typed, model_cfg, _ = resolved("model.n_layer=4", "plan.zero_stage=1")
    from orch.workload import resolve_workload

    workload: Workload = resolve_workload(model_cfg, typed.objective, typed.data)
    from orch.plans.memory.estimate import ModelProbe

    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs)
    activations, seconds = {}, {}
    for name, extra in [("none", ["plan.activation_checkpointing=none"]),
                        ("every 2", ["plan.activation_checkpointing=full", "plan.recompute_every_n_layers=2"]),
                        ("full", ["plan.activation_checkpointing=full"])]:
        t, _, p = resolved("model.n_layer=4", "plan.zero_stage=1", *extra)
        activations[name] = estimate_plan(p, t.cluster, t.optim, probe).per_device.activations
        seconds[name] = declared_plan_step(p, t.cluster, t.optim, probe, probe.stats.param_count).total_s
    assert activations["none"] > activations["every 2"] > activations["full"], activations
    assert seconds["none"] < seconds["every 2"] < seconds["full"], seconds


def test_the_tuner_tries_each_n_with_each_policy_but_none():
    from orch.plans.search.space import SearchSpace

    typed, _, _ = to_typed(compose_config("tune.recompute_every_n_layers=[1,2]"))
    from orch.tune.search import _space

    space = _space(typed, 2, True)
    assert space.recompute_every_n_layers == (1, 2)
    tried = {(p.activation_checkpointing, p.recompute_every_n_layers) for p in space.plans()}
    assert tried == {(Recompute.none, 1), (Recompute.selective, 1), (Recompute.selective, 2), (Recompute.full, 1),
                     (Recompute.full, 2)}
    pipelined = SearchSpace(world_size=2, global_batch_size=8, tp=(1,), pp=(2,), engines=("deepspeed", "fsdp2"),
                            activation_checkpointing=(Recompute.full,), recompute_every_n_layers=(1, 2))
    assert {(p.engine, p.recompute_every_n_layers) for p in pipelined.plans()} == {
        ("deepspeed", 1), ("fsdp2", 1), ("fsdp2", 2)}
    typed, _, _ = to_typed(compose_config("tune.recompute_every_n_layers=[0]"))
    with pytest.raises(PlanError, match="tune.recompute_every_n_layers"):
        _space(typed, 2, True)
