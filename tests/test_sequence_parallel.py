"""``plan.sequence_parallel``: where the layout splits a model, the rules, the planner's activations
and step time, and the tuner's axis. The engine's run is tested in tests/test_fsdp2_e2e.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.config import compose_config, lm_inputs
from orch.checking import checked_run, sequence_parallel_problem
from orch.config import to_typed
from orch.models import model_factory
from orch.plans.errors import PlanError
from orch.plans.memory.estimate import ModelProbe
from orch.plans.parallel.sequence_parallel import (
    SequenceParallelLayout,
    sequence_parallel_layout,
    split_sequence_on_meta,
    stage_layout,
)
from orch.plans.parallel.tp_plan import specs_from_tp_plan, split_layers
from orch.plans.resolve import resolve_plan
from orch.plans.step_time.prediction import declared_plan_step
from orch.workloads.gpt import GPT, TP_LAYER_SPECS

HF_TP = ("model=hf_causal_lm", "plan.engine=fsdp2", "plan.tp=2", "plan.dp=1")


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def test_the_layout_of_a_decoder_names_its_norms_row_layers_and_first_block():
    model = _tiny_llama()
    layout = sequence_parallel_layout(model, split_layers(model, specs_from_tp_plan(model)))
    assert layout.first_block == "model.layers.0"
    assert layout.final_norm == "model.norm"
    assert layout.block_norms == tuple(f"model.layers.{i}.{norm}" for i in range(2)
                                       for norm in ("input_layernorm", "post_attention_layernorm"))
    assert layout.row_layers == tuple(f"model.layers.{i}.{layer}" for i in range(2)
                                      for layer in ("mlp.down_proj", "self_attn.o_proj"))


class _Branchy(nn.Module):
    """A block with a norm more than it has row-parallel layers (a post-norm on one branch)."""

    def __init__(self):
        super().__init__()
        self.norm_in, self.norm_post, self.fc, self.proj = nn.LayerNorm(8), nn.LayerNorm(8), nn.Linear(8, 8), \
            nn.Linear(8, 8)

    def forward(self, x):
        return x + self.norm_post(self.proj(self.fc(self.norm_in(x))))


def test_a_model_of_another_shape_gets_a_reason_not_a_layout():
    assert "no stack of repeated blocks" in sequence_parallel_layout(nn.Linear(4, 4), {})
    model = nn.Sequential(nn.ModuleList([_Branchy(), _Branchy()]), nn.LayerNorm(8))
    kinds = {f"0.{i}.fc": "column" for i in range(2)} | {f"0.{i}.proj": "row" for i in range(2)}
    assert "has 2 norm(s) as direct children and 1 row-parallel layer(s)" in sequence_parallel_layout(model, kinds)


def test_on_meta_the_norms_save_a_slice_and_the_column_layers_the_gathered_whole():
    """The planner's stand-in for the split: the residual stream is 1/tp long between the layers,
    the norms' outputs are whole again in front of the column-parallel layers, and the model's
    output keeps its shape."""
    specs = specs_from_tp_plan(_tiny_llama())
    with torch.device("meta"):
        model = _tiny_llama()
    split_sequence_on_meta(model, specs, 2)
    seen = {}
    model.model.layers[1].input_layernorm.register_forward_hook(
        lambda _m, args, out: seen.update(norm_in=args[0].shape[1], norm_out=out.shape[1]))
    model.model.layers[1].self_attn.o_proj.register_forward_hook(
        lambda _m, args, out: seen.update(o_in=args[0].shape[1]))
    logits = model(input_ids=torch.zeros(2, 16, dtype=torch.long, device="meta")).logits
    assert seen == {"norm_in": 8, "norm_out": 16, "o_in": 16}
    assert tuple(logits.shape) == (2, 16, 64)


def _checked(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*HF_TP, *overrides))
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    step = declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)
    return estimate, step


def test_the_planner_counts_smaller_activations_and_memory_bound_work_and_the_same_traffic():
    whole, whole_step = _checked("plan.sequence_parallel=false")
    split, split_step = _checked("plan.sequence_parallel=true")
    assert split.plan.sequence_parallel and "sequence_parallel=true" in split.plan.layout_text()
    assert split.per_device.activations < whole.per_device.activations
    assert split.per_device.params == whole.per_device.params
    assert split_step.memory_s < whole_step.memory_s
    assert split_step.tp_comm_s == pytest.approx(whole_step.tp_comm_s)
    assert split_step.compute_s == pytest.approx(whole_step.compute_s)


@pytest.mark.parametrize(("overrides", "message", "fix"), [
    (("plan.engine=deepspeed", "plan.zero_stage=1"),
     "the deepspeed engine's tensor parallelism keeps the whole sequence", "set plan.engine=fsdp2"),
    (("plan.tp=1", "plan.dp=2"), "plan.tp=1", "set plan.tp to 2 or more"),
])
def test_plans_that_cannot_split_the_sequence_are_refused_with_the_field_and_the_fix(overrides, message, fix):
    typed, _, _ = to_typed(compose_config(*HF_TP, "plan.sequence_parallel=true", *overrides))
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = [v for v in refused.value.violations if v.field == "plan.sequence_parallel"]
    assert message in violation.message and violation.fix.startswith(fix)


def test_a_sequence_that_does_not_split_evenly_is_refused():
    typed, model_cfg, _ = to_typed(compose_config(*HF_TP, "plan.sequence_parallel=true", "data.seq_len=63"))
    with pytest.raises(PlanError) as refused:
        checked_run(typed, model_cfg)
    [violation] = refused.value.violations
    assert violation.field == "plan.sequence_parallel"
    assert "its sequence of 63 does not split evenly over plan.tp=2 ranks (63 % 2 = 1)" in violation.message


def test_a_pipeline_splits_the_sequence_only_through_layers_that_take_it():
    """A pipeline stage after the first receives its slice of the sequence: its layers must compute
    positions and masks for the whole one (the Hugging Face decoders' ``sequence_shards``); the
    built-in GPT's blocks do not say they can."""
    typed, model_cfg, _ = to_typed(compose_config(*HF_TP, "plan.sequence_parallel=true", "plan.pp=2",
                                                  "cluster.devices_per_node=4", "plan.grad_accum_steps=2"))
    estimate, _, probe, _ = checked_run(typed, model_cfg)
    assert estimate.feasible and probe.pipeline_takes_split_sequence
    gpt = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 128,
           "vocab_size": 256, "tp": 1}
    probe = ModelProbe(model_factory(gpt), lm_inputs(128), tp_layer_specs=TP_LAYER_SPECS,
                       pipeline_layers=lambda: GPT.pipeline_layers(**{k: v for k, v in gpt.items() if k != "_target_"}))
    assert not isinstance(probe.sequence_parallel, str)
    assert sequence_parallel_problem(probe, 2) is None
    assert "its pipeline layers do not take a split sequence" in sequence_parallel_problem(probe, 2, 2)


def test_a_stage_sees_the_layout_under_its_own_names_and_one_module_per_layer():
    whole = SequenceParallelLayout(first_block="m.layers.0", block_norms=("m.layers.0.norm", "m.layers.1.norm"),
                                   final_norm="m.norm", row_layers=("m.layers.0.proj", "m.layers.1.proj"))
    later = stage_layout(whole, {"s.1.layer": "m.layers.1", "s.1.layer.norm": "m.layers.1.norm",
                                 "s.1.layer.proj": "m.layers.1.proj", "s.2.norm": "m.norm", "s.2": ""})
    assert later == SequenceParallelLayout(first_block=None, block_norms=("s.1.layer.norm",), final_norm="s.2.norm",
                                           row_layers=("s.1.layer.proj",))
    with pytest.raises(ValueError, match="stage modules s.0.base.norm and s.2.norm both stand for m.norm"):
        stage_layout(whole, {"s.0.base.norm": "m.norm", "s.2.norm": "m.norm"})


def test_the_tuner_splits_the_sequence_where_an_engine_can_and_the_model_allows():
    from orch.tune.search import _space, prepare

    typed, _, _ = to_typed(compose_config("tune.engines=[deepspeed,fsdp2]", "tune.zero_stages=[1]"))
    assert list(typed.tune.sequence_parallel) == [True]
    plans = list(_space(typed, 4, True).plans())
    split = [p for p in plans if p.sequence_parallel]
    assert split and all(p.engine == "fsdp2" and p.tp > 1 for p in split)
    assert not any(p.engine == "fsdp2" and p.tp > 1 and not p.sequence_parallel for p in plans)
    assert any(p.pp > 1 for p in split) and any(p.tp == 1 for p in plans if p.engine == "fsdp2")
    both = to_typed(compose_config("tune.engines=[fsdp2]", "tune.sequence_parallel=[false,true]"))[0]
    assert {p.sequence_parallel for p in _space(both, 4, True).plans() if p.tp > 1} == {False, True}
    # A model whose sequence cannot be split (images) keeps its tensor-parallel plans, unsplit.
    typed, model_cfg, _ = to_typed(compose_config("experiment=vit_fsdp_bf16", "tune.engines=[fsdp2]"))
    space, _ = prepare(typed, model_cfg, typed.cluster)
    assert space.sequence_parallel == (False,)
