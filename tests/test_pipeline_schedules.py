"""Pipeline schedules as arithmetic and as plan rules, and a pipelined model's names: pure, no
process group (the schedules running in Ray actors are tests/test_pipeline_e2e.py)."""

from __future__ import annotations

import pytest
import torch

from orch.plans.errors import PlanError
from orch.plans.parallel.schedules import (
    BackwardSplit,
    bubble_micro_batches,
    micro_batches_in_flight,
    rank_of_stage,
    schedule_violations,
    split_backward_moments,
    stages_of_rank,
    zbv_actions,
    zero_bubble_actions,
)
from orch.plans.resolve import resolve_plan
from orch.plans.spec import ClusterSpec, FSDPSpec, PipelineSchedule, PlanSpec, TrainSpec

S = PipelineSchedule


def test_looped_and_v_shaped_stage_placement():
    assert [stages_of_rank(r, 4, 2, S.interleaved_1f1b) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, 2, S.zbv) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stages_of_rank(r, 2, 1, S.one_f_one_b) for r in range(2)] == [[0], [1]]
    for schedule, v in ((S.zero_bubble, 3), (S.zbv, 2), (S.gpipe, 1)):
        for stage in range(4 * v):
            assert stage in stages_of_rank(rank_of_stage(stage, 4, v, schedule), 4, v, schedule)


@pytest.mark.parametrize(("schedule", "virtual", "micro", "field", "words"), [
    ("zbv", 1, 4, "plan.pp_virtual_stages", "exactly two stages per rank"),
    ("zbv", 3, 4, "plan.pp_virtual_stages", "exactly two stages per rank"),
    ("interleaved_1f1b", 1, 4, "plan.pp_virtual_stages", "interleaves several stages"),
    ("1f1b", 2, 4, "plan.pp_virtual_stages", "one stage per rank"),
    ("zero_bubble", 2, 5, "plan.grad_accum_steps", "not a multiple of its 2 rounds"),
    ("bogus", 1, 4, "plan.pp_schedule", "is not a pipeline schedule"),
])
def test_schedule_rules_name_the_field_and_the_fix(schedule, virtual, micro, field, words):
    found = schedule_violations(schedule, pp=2, virtual=virtual, micro_batches=micro)
    assert [v.field for v in found] == [field]
    assert words in found[0].message and found[0].fix


def test_schedules_are_not_read_without_a_pipeline_and_interleaving_needs_layers():
    assert schedule_violations("zbv", pp=1, virtual=1, micro_batches=1) == []
    assert schedule_violations("interleaved_1f1b", pp=2, virtual=2, micro_batches=3) == []
    found = schedule_violations("interleaved_1f1b", pp=4, virtual=2, micro_batches=8, layers=6)
    assert [v.field for v in found] == ["plan.pp_virtual_stages"] and "8 stages" in found[0].message


def test_bubbles_follow_the_papers():
    """1F1B idles p - 1 micro-batches; interleaving divides that by v; zero bubble moves the
    weights' backward into it (F = B = W: a third left, over v); ZB-V leaves none."""
    assert bubble_micro_batches(S.one_f_one_b, 4, 1) == pytest.approx(3)
    assert bubble_micro_batches(S.gpipe, 4, 1) == pytest.approx(3)
    assert bubble_micro_batches(S.interleaved_1f1b, 4, 2) == pytest.approx(1.5)
    assert bubble_micro_batches(S.zero_bubble, 4, 2) == pytest.approx(0.5)
    assert bubble_micro_batches(S.zbv, 4, 2) == pytest.approx(0.0)
    # A recomputed forward lengthens B: ZB-V then idles (F + B - 2W) = 1/4 of a micro-batch per fill.
    assert bubble_micro_batches(S.zbv, 4, 2, BackwardSplit.of_matmuls(1.0)) == pytest.approx(3 * 0.25 / 2)
    assert bubble_micro_batches(S.one_f_one_b, 1, 1) == 0


def test_micro_batches_held_per_schedule():
    """GPipe holds the step's every micro-batch, 1F1B pp - r, interleaved 1F1B Megatron-LM's
    p + (p - 1 - 2r) / v, ZB-V what 1F1B's first rank holds (given the 2p - 1 micro-batches its V
    is laid out for; with fewer, its first ranks hold less). The looped zero-bubble schedule warms
    up a forward less per later rank than interleaved 1F1B, but rank r keeps r micro-batches more
    until their deferred weight backwards: every rank holds p."""
    assert micro_batches_in_flight(S.gpipe, 4, 1, 16) == 16
    assert [micro_batches_in_flight(S.one_f_one_b, 4, 1, 16, r) for r in range(4)] == [4, 3, 2, 1]
    assert micro_batches_in_flight(S.interleaved_1f1b, 4, 2, 16, 0) == pytest.approx(4 + 3 / 2)
    assert [micro_batches_in_flight(S.zbv, 4, 2, 16, r) for r in range(4)] == [4, 4, 4, 4]
    assert [micro_batches_in_flight(S.zbv, 4, 2, 4, r) for r in range(4)] == [2.5, 3, 3.5, 4]
    assert [micro_batches_in_flight(S.zero_bubble, 4, 2, 8, r) for r in range(4)] == [4, 4, 4, 4]
    assert micro_batches_in_flight(S.gpipe, 4, 1, 2) == 2


def _resolve(**plan) -> object:
    return resolve_plan(PlanSpec(**plan), ClusterSpec(nodes=1, devices_per_node=4), TrainSpec())


def test_engines_refuse_the_schedules_they_do_not_run():
    with pytest.raises(PlanError) as raised:
        _resolve(engine="deepspeed", pp=2, pp_schedule="zbv", pp_virtual_stages=2, grad_accum_steps=4)
    assert [v.field for v in raised.value.violations] == ["plan.pp_schedule"]
    assert "plan.engine=fsdp2" in raised.value.violations[0].fix
    with pytest.raises(PlanError) as raised:
        _resolve(engine="fsdp2", pp=2, pp_schedule="zbv", pp_virtual_stages=2, grad_accum_steps=4)
    assert [v.field for v in raised.value.violations] == ["plan.fsdp.reshard_after_forward"]
    with pytest.raises(PlanError) as raised:
        _resolve(engine="fsdp2", pp=2, grad_accum_steps=1)
    assert [v.field for v in raised.value.violations] == ["plan.grad_accum_steps"]
    # DeepSpeed's own 1F1B runs fewer micro-batches than stages.
    assert _resolve(engine="deepspeed", pp=2, grad_accum_steps=1).pp == 2


def test_a_resolved_pipeline_plan_says_its_schedule():
    plan = _resolve(engine="fsdp2", pp=2, pp_schedule="zbv", pp_virtual_stages=2, grad_accum_steps=4,
                    fsdp=FSDPSpec(reshard_after_forward=False))
    assert plan.pp_schedule is S.zbv and plan.pipeline_stages == 4
    assert "pp_schedule=zbv pp_virtual_stages=2" in plan.layout_text()
    assert plan.as_dict()["pp_schedule"] == "zbv"
    assert "pp_schedule" not in _resolve(engine="fsdp2", pp=2, grad_accum_steps=2).layout_text()


def _whole_names(specs, layout) -> tuple[set[str], list]:
    from orch.launchers.engines.fsdp2.pipeline_stages import Stages, StateNames

    torch.manual_seed(0)
    names, ranks = set(), []
    for rank in range(layout.pp):
        stages = Stages(specs, layout, rank)
        state = stages.state_dict()
        saved = StateNames(stages).to_save(state)
        names |= set(saved)
        ranks.append((stages, state, saved))
    return names, ranks


@pytest.mark.parametrize("schedule", [S.one_f_one_b, S.interleaved_1f1b, S.zbv])
def test_pipeline_stages_save_under_the_whole_gpts_names(schedule):
    """Every stage's state, renamed, is the unpipelined GPT's state dict: together the ranks
    save every name of it, each once (the head's copy of the tied embedding is left out), so a
    checkpoint resumes at any pp."""
    from orch.launchers.engines.fsdp2.pipeline_stages import Cut, StateNames
    from orch.workloads.gpt import GPT

    specs = GPT.pipeline_layers(n_layer=4, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    virtual = 1 if schedule is S.one_f_one_b else 2
    bounds = [0, 2, 7] if virtual == 1 else [0, 2, 3, 4, 7]
    names, ranks = _whole_names(specs, Cut(bounds=bounds, schedule=schedule, pp=2, virtual=virtual))
    whole = set(GPT(n_layer=4, d_model=32, n_head=2, seq_len=16, vocab_size=64).state_dict())
    assert names == whole
    assert sum(len(saved) for _, _, saved in ranks) == len(whole)
    # Loading: a rank holding the head's copy fills it from the embedding's saved name.
    holder = next(stages for stages, _, _ in ranks if any(k.endswith("wte.weight") for k in StateNames(stages)
                                                          .to_load(stages.state_dict())))
    loaded = StateNames(holder).to_load(holder.state_dict())
    assert "embed.wte.weight" in loaded
    back = StateNames(holder).loaded(list(holder.state_dict()), loaded)
    copies = [key for key in back if key.endswith("wte.weight")]
    assert copies and all(back[key] is loaded["embed.wte.weight"] for key in copies)


def test_pipeline_stages_of_a_hugging_face_decoder_save_under_its_names():
    from orch.launchers.engines.fsdp2.pipeline_stages import Cut
    from orch.workloads.hf import hf_causal_lm
    from orch.workloads.hf_pipeline import pipeline_layers

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
              "tie_word_embeddings": True}
    torch.manual_seed(0)
    specs = pipeline_layers(config=config)
    names, _ = _whole_names(specs, Cut(bounds=[0, 2, 5], schedule=S.one_f_one_b, pp=2, virtual=1))
    assert names == set(hf_causal_lm(config=config).state_dict())


def test_the_stage_computing_the_loss_alone_pays_the_loss_and_head_backward():
    """The whole model's backward peak outside its repeated layers (the loss's and head's) is the
    last stage's alone, the others paying their share of the layers' backward; also when the two
    were not told apart by a parameter gradient (a head tied to the input embedding, whose weight's
    gradient is accumulated only after the embedding's backward)."""
    from orch.plans.memory.activations import ActivationBytes
    from orch.plans.parallel.pipeline import PipelineStage, stage_activations

    mib = 2**20
    told = ActivationBytes(saved=40 * mib, recompute_peak=0, forward_peak=50 * mib, backward_peak=90 * mib,
                           backward_peak_with_grads=90 * mib, blocks_backward_peak=50 * mib,
                           loss_backward_peak=90 * mib, head_backward_peak=70 * mib)
    tied = ActivationBytes(**{**told.__dict__, "loss_backward_peak": 0, "head_backward_peak": 0})

    def stage(index: int) -> PipelineStage:
        return PipelineStage(index=index, start=index, stop=index + 1, layers=("Block",), params=1, trainable=1,
                             largest_param=1, saved_bytes=1, in_flight=1)

    for whole in (told, tied):
        first, last = (stage_activations(whole, stage(i), 2, holds_loss=i == 1) for i in (0, 1))
        assert first.backward_peak == 25 * mib  # half the layers' backward peak
        assert last.backward_peak == 20 * mib + 90 * mib - 40 * mib  # its share of the saved, and the tail
        # The forward's peak above the saved bytes is the loss's: the first stage peaks at its share.
        assert (first.forward_peak, last.forward_peak) == (20 * mib, 20 * mib + 50 * mib - 40 * mib)
        # torch's PipelineStage keeps the last stage's output (the logits) to its backward, which
        # the whole model freed once the loss had what it saves: the last stage alone pays it.
        held = [stage_activations(whole, stage(i), 2, holds_loss=i == 1, held_output=8 * mib) for i in (0, 1)]
        assert held[0] == first and held[1].backward_peak == last.backward_peak + 8 * mib
        # Apart, for FSDP2's phases: inside the blocks each stage's share of their peak (the held
        # output beside it), the loss's backward on the loss stage alone, where it was told apart.
        assert (held[0].blocks_backward_peak, held[1].blocks_backward_peak) == (25 * mib, 33 * mib)
        assert held[0].loss_backward_peak == 0
        assert held[1].loss_backward_peak == (20 * mib + 90 * mib - 40 * mib + 8 * mib if whole is told else 0)


def test_the_split_backwards_input_gradients_are_dropped_after_the_step():
    """torch's split backward (the zero-bubble schedules' input half) leaves each received input's
    gradient in its ``.grad``, on a receive buffer that lives from step to step; the engine drops
    them after every step (the full backward clears them itself)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining._backward import stage_backward_input

    from orch.launchers.engines.fsdp2.pipeline import drop_input_gradients

    layer = torch.nn.Linear(4, 4)
    buffer = torch.randn(2, 4, requires_grad=True)  # a stage's receive buffer for one micro-batch
    output = layer(buffer)
    stage_backward_input([output], [torch.ones_like(output)], [buffer], layer.parameters())
    assert buffer.grad is not None and buffer.grad.shape == buffer.shape
    stage = SimpleNamespace(args_recv_info={0: (SimpleNamespace(buffer=buffer), SimpleNamespace(buffer=None))})
    drop_input_gradients([stage])
    assert buffer.grad is None


def _torch_zbv_order(pp: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """One rank's actions as torch's ``ScheduleZBVZeroBubble`` lays them out, read through its
    private per-rank method: the schedule object itself needs stages with process groups."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    me = SimpleNamespace(pp_group_size=pp, _n_microbatches=micro_batches, num_stages=2 * pp)
    return [(a.computation_type.value, 0 if a.stage_index == rank else 1, a.microbatch_index)
            for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(me, rank) if a is not None]


def test_zbv_runs_each_rank_in_torchs_order_and_its_later_ranks_defer_weight_backwards():
    """The planner's ZB-V order is torch's, for every rank, with fewer micro-batches than the V
    needs and with more. Its first rank runs each weight backward at once; rank r defers r of each
    chunk's into the drain (and one more of chunk 0 as the drain begins), each micro-batch's
    activations held until then."""
    for pp in range(1, 7):
        for micro_batches in range(1, 3 * pp + 2):
            for rank in range(pp):
                assert zbv_actions(pp, micro_batches, rank) == _torch_zbv_order(pp, micro_batches, rank)
    first, last = (split_backward_moments(S.zbv, 8, 2, 16, r) for r in (0, 7))
    assert all(moment.waiting_weights == (0, 0) for moment in first)
    assert max(sum(moment.held) for moment in first) == 16  # 1F1B's first rank: pp micro-batches, two chunks
    assert max(moment.waiting_weights for moment in last) == (7, 7)
    fullest = next(moment for moment in last if moment.waiting_weights == (7, 7))
    assert fullest.held == (8, 7)


def test_the_looped_zero_bubble_runs_each_rank_in_torchs_order_and_defers_r_weight_backwards():
    """The looped zero-bubble order is torch's ``ScheduleInterleavedZeroBubble``'s (read through its
    private per-rank method, before the bubbles it aligns the ranks with, which reorder nothing):
    interleaved 1F1B with each weight backward ``r`` input backwards late on rank ``r``."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    for pp in range(2, 6):
        for virtual in (2, 3):
            for micro_batches in range(pp, 3 * pp + 1):
                rounds = max(1, micro_batches // pp)
                if micro_batches % rounds:
                    continue  # refused (schedule_violations)
                for rank in range(pp):
                    me = SimpleNamespace(pp_group_size=pp, _n_microbatches=micro_batches, n_local_stages=virtual,
                                         number_of_rounds=rounds, microbatches_per_round=micro_batches // rounds)
                    theirs = [(a.computation_type.value, a.stage_index // pp, a.microbatch_index)
                              for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(me, rank)
                              if a is not None]
                    assert zero_bubble_actions(pp, virtual, micro_batches, rank) == theirs
    assert all(sum(m.waiting_weights) == 0 for m in split_backward_moments(S.zero_bubble, 4, 2, 8, 0))
    assert max(sum(m.waiting_weights) for m in split_backward_moments(S.zero_bubble, 4, 2, 8, 3)) == 3


def test_zbv_ranks_count_the_gradients_their_deferred_weight_backwards_keep():
    """A ZB-V rank's fullest input backward, counted from torch's own order: each chunk's held
    micro-batches' activations and its waiting weight backwards' gradients, above the pp
    micro-batches through both chunks the schedule is otherwise priced at. The first stage keeps
    no gradients for later (torch runs its whole backward in its weight pass), so the first rank,
    which runs every other weight backward at once, holds nothing more."""
    from orch.plans.parallel.pipeline import PipelineLayer, pipeline_stages, rank_stages

    pp, micro_batches, saved, kept = 4, 8, 1000, 300
    layers = [PipelineLayer(name="Block", params=10, trainable=10, largest_param=10, saved_bytes=saved,
                            output_bytes=1, weight_grad_bytes=kept) for _ in range(2 * pp)]
    stages = pipeline_stages(layers, pp=2 * pp, method="uniform", micro_batches=micro_batches, engine="fsdp2")
    ranks = rank_stages(stages, layers, schedule=S.zbv, pp=pp, virtual=2, micro_batches=micro_batches)

    def by_hand(rank: int) -> int:
        held, waiting, fullest = [set(), set()], [set(), set()], 0
        for kind, chunk, micro_batch in _torch_zbv_order(pp, micro_batches, rank):
            if kind == "F":
                held[chunk].add(micro_batch)
            elif kind == "I":
                grads = sum(len(w) for c, w in enumerate(waiting) if not (rank == 0 and c == 0))
                fullest = max(fullest, saved * sum(len(h) for h in held) + kept * grads)
                waiting[chunk].add(micro_batch)
            else:
                held[chunk].discard(micro_batch)
                waiting[chunk].discard(micro_batch)
        return max(0, fullest - pp * 2 * saved)

    assert [r.split_backward_bytes for r in ranks] == [by_hand(r) for r in range(pp)]
    # The last rank's fullest: three weight backwards of each chunk waiting, one micro-batch fewer held.
    assert ranks[0].split_backward_bytes == 0 and ranks[-1].split_backward_bytes == 6 * kept - saved
    one_f_one_b = rank_stages(pipeline_stages(layers, pp=pp, method="uniform", micro_batches=micro_batches,
                                              engine="fsdp2"), layers, schedule=S.one_f_one_b, pp=pp, virtual=1,
                              micro_batches=micro_batches)
    assert all(r.split_backward_bytes == 0 for r in one_f_one_b)
