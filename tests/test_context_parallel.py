"""``plan.cp``: which tokens a rank keeps, attention over the parts, the rules, the planner's memory
and step time, and the tuner's axis. The engine's run is tested in tests/test_fsdp2_e2e.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.config import compose_config, lm_inputs
from orch.checking import checked_run
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.parallel.context_parallel import (
    chunk_order,
    forward_problem,
    gathered_chunks,
    local_positions,
    lower_right_mask,
    sequence_problem,
    split_attention,
)
from orch.plans.parallel.rank_layout import global_rank, group_stride, parallel_coords
from orch.plans.resolve import resolve_plan
from orch.plans.step_time.prediction import declared_plan_step

HF = ("model=hf_causal_lm", "plan.engine=fsdp2", "plan.dp=1")


def test_each_rank_keeps_an_early_and_a_late_chunk():
    assert [chunk_order(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert gathered_chunks(2) == [0, 3, 1, 2]
    assert local_positions(8, 0, 2) == [0, 1, 6, 7] and local_positions(8, 1, 2) == [2, 3, 4, 5]
    # Every position is kept by exactly one rank.
    assert sorted(p for r in range(4) for p in local_positions(64, r, 4)) == list(range(64))
    assert lower_right_mask(2, 4, "cpu").tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize(("heads", "kv_heads", "cp"), [(4, 4, 2), (4, 2, 2), (6, 2, 3)])
def test_the_parts_attend_as_the_whole_sequence_does(heads, kv_heads, cp):
    """Each rank's queries over every rank's gathered keys give the rows of whole causal attention
    (grouped-query keys included), and the causal work is the same on every rank."""
    torch.manual_seed(0)
    seq = 4 * cp
    q, k, v = torch.randn(2, heads, seq, 8), torch.randn(2, kv_heads, seq, 8), torch.randn(2, kv_heads, seq, 8)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    parts = [torch.tensor(local_positions(seq, r, cp)) for r in range(cp)]

    def gather(_local):  # every rank's part, in rank order, as the all-gather returns them
        return torch.cat([k.index_select(2, p) for p in parts], 2) if _local.data_ptr() == keys[0].data_ptr() \
            else torch.cat([v.index_select(2, p) for p in parts], 2)

    work = []
    for rank, positions in enumerate(parts):
        keys = [k.index_select(2, positions)]
        calls = []

        def counted(query, key, value, calls=calls, **kwargs):
            calls.append(query.shape[2] * key.shape[2])
            return F.scaled_dot_product_attention(query, key, value, **kwargs)

        out = split_attention(q.index_select(2, positions), keys[0], v.index_select(2, positions), gather=gather,
                              cp_rank=rank, cp=cp, sdpa=counted, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, whole.index_select(2, positions))
        work.append(sum(calls))
    assert len(set(work)) == 1


def test_attention_with_a_mask_or_not_causal_is_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="splits causal attention without a mask; .* set plan.cp=1"):
        split_attention(q, q, q, gather=lambda t: torch.cat([t, t], 2), cp_rank=0, cp=2,
                        sdpa=F.scaled_dot_product_attention, is_causal=False)


def test_the_rank_grid_puts_context_parallel_ranks_between_tensor_and_pipeline_ranks():
    world, tp, pp, cp = 16, 2, 2, 2
    for rank in range(world):
        c = parallel_coords(rank, world, tp, pp, cp)
        assert global_rank(c.dp_rank, c.pp_rank, c.tp_rank, tp=tp, pp=pp, cp_rank=c.cp_rank, cp=cp) == rank
    assert parallel_coords(2, 8, 2, 1, 2) == parallel_coords(2, 8, 2, 1, 2).__class__(dp_rank=0, tp_rank=0, cp_rank=1)
    assert [group_stride(kind, tp, pp, cp) for kind in ("tp", "cp", "pp", "dp")] == [1, 2, 4, 8]


def test_a_part_of_the_sequence_is_called_with_its_positions_unless_the_batch_gives_them():
    from orch.plans.parallel.context_parallel import call_kwargs
    from orch.workloads.gpt import GPT

    positions = torch.tensor([[0, 1, 6, 7]])
    gpt = GPT(n_layer=1, d_model=16, n_head=2, seq_len=8)
    assert call_kwargs(gpt, positions).keys() == {"position_ids"}
    llama = _tiny_llama()
    assert call_kwargs(llama, positions)["attention_mask"].tolist() == [[1, 1, 1, 1]]
    batch = {"input_ids": positions, "attention_mask": torch.ones(1, 4), "position_ids": positions}
    assert call_kwargs(llama, positions, batch) == {}


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def test_a_sequence_and_a_model_that_cannot_be_split_get_reasons():
    assert "does not split into 2 * cp = 4 equal chunks (30 % 4 = 2)" in sequence_problem(30, 2)
    assert sequence_problem(32, 2) is None
    assert "do not split over the tp(3) ranks" in sequence_problem(32, 2, tp=3, sequence_parallel=True)
    assert "takes no position_ids" in forward_problem(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("overrides", "field", "message", "fix"), [
    (("plan.engine=deepspeed", "plan.zero_stage=1"), "plan.cp",
     "the deepspeed engine keeps each sample's whole sequence", "set plan.engine=fsdp2"),
    (("plan.fsdp.hybrid=true",), "plan.fsdp.hybrid", "hybrid sharding of that pair is not built",
     "set plan.fsdp.hybrid=false"),
    (("plan.cp=3", "plan.dp=null"), "plan.cp", "tp(1) * pp(1) * cp(3) = 3 does not divide the world size 2",
     "choose tp, pp and cp"),
])
def test_plans_that_cannot_split_the_sequence_are_refused_with_the_field_and_the_fix(overrides, field, message, fix):
    typed, _, _ = to_typed(compose_config(*HF, "plan.cp=2", *overrides))
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = [v for v in refused.value.violations if v.field == field]
    assert message in violation.message and violation.fix.startswith(fix)


def test_a_sequence_that_does_not_cut_into_chunks_is_refused_before_launch():
    typed, model_cfg, _ = to_typed(compose_config(*HF, "plan.cp=2", "data.seq_len=62"))
    with pytest.raises(PlanError) as refused:
        checked_run(typed, model_cfg)
    [violation] = refused.value.violations
    assert violation.field == "plan.cp" and "62 % 4 = 2" in violation.message


def _checked(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*HF, *overrides))
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    return estimate, declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)


def test_the_planner_counts_a_rank_s_part_of_the_work_and_the_gathers():
    """At cp=2 a rank keeps about half the activations (the gathered keys and values whole), its
    parameters are sharded over both ranks, it computes half the FLOPs and memory-bound bytes, and
    moves the keys and values."""
    whole, whole_step = _checked("cluster.devices_per_node=1")
    split, split_step = _checked("plan.cp=2")
    assert "cp=2" in split.plan.layout_text() and split.plan.dp == 1
    assert whole.per_device.activations * 0.4 < split.per_device.activations < whole.per_device.activations * 0.8
    assert split.per_device.params == pytest.approx(whole.per_device.params / 2, rel=0.05)
    # Half the FLOPs, as many kernel launches (each rank runs every layer's kernels).
    assert whole_step.compute_s / 2 < split_step.compute_s < whole_step.compute_s
    assert split_step.memory_s == pytest.approx(whole_step.memory_s / 2, rel=0.05)
    assert whole_step.cp_comm_s == 0 < split_step.cp_comm_s
    assert split_step.as_dict()["parts_s"]["cp"] == split_step.cp_comm_s


def test_pipeline_stages_split_the_sequence_through_layers_that_take_positions():
    """cp=2 x pp=2 on 4 ranks: each stage runs on a rank's part of the sequence, so it sends half
    the boundary activation and holds about half the activations of the pp=2 plan, and its
    key/value gathers are its stage's share of the pp=1 plan's. A model whose pipeline layers take
    no positions (``context_positions``) is refused with the field and the fix."""
    four = ("cluster.devices_per_node=4", "plan.grad_accum_steps=2")
    piped, piped_step = _checked("plan.pp=2", *four[1:], "cluster.devices_per_node=2")
    both, both_step = _checked("plan.pp=2", "plan.cp=2", *four)
    alone, alone_step = _checked("plan.cp=2", *four[1:], "cluster.devices_per_node=2")
    assert (both.plan.pp, both.plan.cp, both.plan.dp) == (2, 2, 1)
    assert [s.boundary_buffer_bytes for s in both.pipeline] == [-(-s.boundary_buffer_bytes // 2)
                                                                 for s in piped.pipeline]
    assert piped.per_device.activations * 0.4 < both.per_device.activations < piped.per_device.activations * 0.8
    assert both_step.pp_comm_s < piped_step.pp_comm_s
    # The model's 4 layers split evenly: each stage gathers for half the attention calls.
    assert both_step.cp_comm_s == pytest.approx(alone_step.cp_comm_s / 2) and both_step.cp_comm_s > 0
    assert both_step.bubble_s > 0 and both_step.compute_s < piped_step.compute_s
    # A stage's FSDP2 shard group is its two context-parallel ranks, neighbours: on two nodes of
    # two they share a node, as on one node of four; the pipeline ranks are the ones apart.
    _, two_nodes = _checked("plan.pp=2", "plan.cp=2", *four[1:], "cluster.devices_per_node=2", "cluster.nodes=2")
    assert two_nodes.dp_comm_s == both_step.dp_comm_s and two_nodes.pp_comm_s > both_step.pp_comm_s

    from orch.checking import context_parallel_problem
    from orch.models import model_factory
    from orch.plans.memory.estimate import ModelProbe
    from orch.plans.parallel.stage_layers import StageLayer
    from orch.workloads.gpt import GPT, TP_LAYER_SPECS

    gpt = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 128}
    layers = GPT.pipeline_layers(**{k: v for k, v in gpt.items() if k != "_target_"})
    probe = ModelProbe(model_factory(gpt), lm_inputs(128), tp_layer_specs=TP_LAYER_SPECS,
                       pipeline_layers=lambda: layers)
    assert probe.pipeline_takes_positions and context_parallel_problem(probe, 2, pp=2) is None
    unnumbered = [StageLayer.of(torch.nn.LayerNorm, 64)] * 2
    probe = ModelProbe(model_factory(gpt), lm_inputs(128), pipeline_layers=lambda: unnumbered)
    assert "its pipeline layers take no positions" in context_parallel_problem(probe, 2, pp=2)
    assert context_parallel_problem(probe, 2, pp=1) is None


def test_the_tuner_splits_long_sequences_over_context_parallel_ranks():
    from orch.tune.search import _context_degrees, _space

    assert _context_degrees(None, 8192) == (1,)
    assert _context_degrees(None, 131072) == (1, 2, 4, 8)
    assert _context_degrees(None, 32768) == (1, 2)
    assert _context_degrees([2, 1, 2], 128) == (2, 1)
    typed, _, _ = to_typed(compose_config("tune.engines=[deepspeed,fsdp2]", "tune.zero_stages=[1]"))
    space = _space(typed, 4, True)
    plans = list(type(space)(**{**space.__dict__, "cp": (1, 2)}).plans())
    split = [p for p in plans if p.cp > 1]
    assert split and all(p.engine == "fsdp2" for p in split) and {p.pp for p in split} == {1, 2}
    assert {p.compile for p in split} == {False, True}
    assert {p.dp * p.tp * p.pp * p.cp for p in split} == {4}
