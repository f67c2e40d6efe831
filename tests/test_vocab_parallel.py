"""The output head split over the vocabulary (``plan.loss_parallel``) as the planner counts it:
which heads and plans split, and what a split head takes off a rank's memory and step. All pure:
models on ``meta``, no Ray, no torch.distributed. The engine trains with it in
tests/test_fsdp2_engine.py (loss, clipping, checkpoint at tp=2, resumed at tp=1) and
tests/test_fsdp2_e2e.py (with sequence and context parallelism, through Ray)."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from helpers.config import compose_config
from orch.config import to_typed
from orch.plans.memory.estimate import ModelProbe, check_plan, estimate_plan
from orch.plans.model.meta import meta_device
from orch.plans.parallel.vocab_parallel import OutputHead, describe_head, kept_whole, output_head, splits_head
from orch.plans.resolve import resolve_plan
from orch.plans.step_time.prediction import count_model_cost, declared_plan_step, plan_step
from orch.plans.step_time.profile import cluster_speeds
from orch.workload import resolve_workload
from orch.workloads.objectives import CausalLM, Classification

UNTIED = ("model=hf_causal_lm", "model.config.tie_word_embeddings=false", "model.config.vocab_size=4096",
          "plan.dp=1", "plan.tp=2", "plan.precision=fp32")


def resolved(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return typed, model_cfg, resolve_plan(typed.plan, typed.cluster, typed.train)


def llama(tied: bool):
    from orch.workloads.hf import hf_causal_lm

    with meta_device():
        return hf_causal_lm({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
                             "tie_word_embeddings": tied})


def test_the_head_is_an_untied_output_layer_under_a_cross_entropy_objective():
    assert output_head(llama(tied=False), CausalLM()) == OutputHead(name="lm_head", classes=300)
    # Its weight is the embedding's (tie_word_embeddings): split with it.
    assert output_head(llama(tied=True), CausalLM()) == OutputHead(name="lm_head", classes=300,
                                                                   embedding="model.embed_tokens")
    assert output_head(llama(tied=False), Classification()) is None  # no such declaration: kept whole
    assert output_head(llama(tied=False), lambda outputs, batch: outputs.sum()) is None
    from orch.workloads.gpt import GPT

    untied = GPT(n_layer=1, d_model=32, n_head=2, seq_len=8, tie_embeddings=False)
    assert output_head(untied, CausalLM()) == OutputHead(name="lm_head.proj", classes=256)
    # The GPT's tied head takes the token embedding's weight at each call, and says so: split with it.
    tied = GPT(n_layer=1, d_model=32, n_head=2, seq_len=8)
    assert output_head(tied, CausalLM()) == OutputHead(name="lm_head", classes=256, embedding="embed.wte")
    assert OutputHead("lm_head", 300).layer_spec == {"patterns": [r"^lm_head\.weight$"], "partition_type": "column"}
    assert OutputHead("lm_head", 300, "embed.wte").layer_spec == {"patterns": [r"^embed\.wte\.weight$"],
                                                                  "partition_type": "column"}


def test_only_fsdp2_plans_with_tp_split_the_head_and_say_why_not():
    head = OutputHead("lm_head", 4096)
    _, _, plan = resolved(*UNTIED, "plan.engine=fsdp2")
    assert splits_head(plan, head) and kept_whole(plan, head) is None
    assert describe_head(plan, head) == ("lm_head split over the vocabulary (4,096 / tp=2 per rank), the loss "
                                         "computed from the split logits (plan.loss_parallel)")
    assert not splits_head(plan, None) and describe_head(plan, None) == ""
    reasons = {
        "plan.engine=deepspeed": "the deepspeed engine keeps it whole",
        "plan.loss_parallel=false": "plan.loss_parallel=false",
    }
    for override, why in reasons.items():
        _, _, other = resolved(*UNTIED, "plan.engine=fsdp2", override)
        assert not splits_head(other, head) and kept_whole(other, head) == why
        assert describe_head(other, head) == f"lm_head (4,096 classes) whole on every tensor-parallel rank: {why}"
    _, _, piped = resolved(*UNTIED, "plan.engine=fsdp2", "plan.pp=2", "plan.grad_accum_steps=2",
                           "cluster.devices_per_node=4")
    assert splits_head(piped, head)  # on the last stage
    assert kept_whole(plan, OutputHead("lm_head", 301)) == "its 301 classes do not split 2 ways"
    _, _, one = resolved(*UNTIED, "plan.engine=fsdp2", "plan.tp=1", "plan.dp=2")
    assert not splits_head(one, head) and describe_head(one, head) == ""
    assert "loss_parallel=false" in resolved(*UNTIED, "plan.engine=fsdp2", "plan.loss_parallel=false")[2].layout_text()
    assert "loss_parallel" not in plan.layout_text()


def _assert_split_saves_half_the_head(typed, workload, probe, split, whole, head_params: int) -> None:
    """fp32 plans at tp=2 over a 4096-way vocabulary: the split one counts half the head's parameters
    and about half its logits (and their fp32 log-softmax for the loss) less than the whole one."""
    estimates = {name: estimate_plan(plan, typed.cluster, typed.optim, probe) for name, plan in
                 (("split", split), ("whole", whole))}
    assert estimates["whole"].states.params - estimates["split"].states.params == 4 * (head_params // 2)
    logits = split.micro_batch_size * workload.tokens_per_sample * 4096 * 4
    saved = estimates["whole"].per_device.activations - estimates["split"].per_device.activations
    assert logits // 2 <= saved <= 3 * logits, (saved, logits)


def test_a_split_head_takes_its_share_of_parameters_logits_and_matmuls_off_each_rank():
    typed, model_cfg, split = resolved(*UNTIED, "plan.engine=fsdp2")
    whole = dataclasses.replace(split, loss_parallel=False)
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs)
    assert probe.output_head == OutputHead("lm_head", 4096)
    assert probe.for_plan(whole) is probe and probe.for_plan(split) is probe.split_head
    hidden = 128
    head_params = 4096 * hidden
    _assert_split_saves_half_the_head(typed, workload, probe, split, whole, head_params)
    # DeepSpeed keeps the head whole: its count is the unsplit one.
    _, _, deepspeed = resolved(*UNTIED, "plan.engine=deepspeed")
    assert probe.for_plan(deepspeed) is probe
    assert check_plan(split, typed.cluster, typed.optim, probe).output_head.startswith("lm_head split over")

    model = count_model_cost(probe, [1, 2], probe.stats.param_count)
    assert model.split_head is not None and model.split_head.split_head is None
    assert model.tp_param_count[2] - model.split_head.tp_param_count[2] == head_params // 2
    # The head's input gradient is all-reduced in backward, as every column-parallel layer's is.
    assert model.split_head.column_parallel_layers == model.column_parallel_layers + 1
    speeds, _ = cluster_speeds(typed.cluster, split.precision)
    steps = {name: plan_step(plan, model, speeds, probe, devices_per_node=typed.cluster.devices_per_node,
                             optim=typed.optim) for name, plan in (("split", split), ("whole", whole))}
    assert steps["split"].compute_s < steps["whole"].compute_s and steps["split"].tp_comm_s > steps["whole"].tp_comm_s
    assert steps["split"].total_s < steps["whole"].total_s
    # orch check prices the declared plan the same way.
    declared = declared_plan_step(split, typed.cluster, typed.optim, probe, probe.stats.param_count)
    assert declared.total_s == pytest.approx(steps["split"].total_s)


def pipelined_untied():
    """The untied Llama shape at tp=2 x pp=2 on the fsdp2 engine: its config, plan and probe (the
    head split, as the plan splits it)."""
    overrides = (*UNTIED, "plan.engine=fsdp2", "plan.pp=2", "plan.grad_accum_steps=2", "cluster.devices_per_node=4")
    typed, model_cfg, plan = resolved(*overrides)
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs,
                       pipeline_layers=workload.pipeline_layers).for_plan(plan)
    return typed, plan, probe


def test_pipeline_layers_count_what_tensor_parallelism_splits_of_each_by_the_whole_models_names():
    """The split parameters are found layer by layer (a stage's layers matched by the whole model's
    names, as the fsdp2 engine matches them): all of the model's, none of the embedding's, the head's
    on the last layer; a stage then keeps its own layers' share, not the model's proportion."""
    typed, plan, probe = pipelined_untied()
    layers = probe.pipeline_layer_facts(plan)
    assert sum(layer.tp_params for layer in layers) == probe.tensor_parallel_params[0]
    assert layers[0].tp_params == 0 and layers[-1].tp_params == layers[-1].params == 4096 * 128
    estimate = estimate_plan(plan, typed.cluster, typed.optim, probe)
    first = probe.stages(plan)[0]
    kept = first.params - first.tp_params + first.tp_params // 2
    assert estimate.stages[0].params == 4 * kept  # fp32 parameters


def test_pipeline_layers_save_what_one_tensor_parallel_rank_saves():
    """At tp > 1 each pipeline layer runs sharded by the whole model's names, the head's loss split
    as the whole model's is: the split layers save less, the head's logits (the last layer's
    output) halve, and a stage's share of the activations is its share of what the ranks save, not
    of the unsharded layers' (where a whole head's logits made the last stage's share too large).
    The parameter counts stay the whole layers', by which the stages are cut."""
    typed, plan, probe = pipelined_untied()
    sharded = probe.pipeline_layer_facts(plan)
    whole = probe.pipeline_layer_facts(dataclasses.replace(plan, tp=1))
    assert [layer.params for layer in sharded] == [layer.params for layer in whole]
    assert sharded[-1].output_bytes == whole[-1].output_bytes // 2
    assert all(s.saved_bytes < w.saved_bytes for s, w in zip(sharded, whole, strict=True) if w.tp_params)
    first, last = probe.stages(plan)
    assert sum(layer.saved_bytes for layer in sharded) == first.saved_bytes + last.saved_bytes
    share = last.saved_bytes / (first.saved_bytes + last.saved_bytes)
    assert share < sum(layer.saved_bytes for layer in whole[last.start:]) / sum(layer.saved_bytes for layer in whole)


def _assert_tied_head_splits(overrides: tuple[str, ...], head: OutputHead, hidden_key: str):
    """At tp=2 the tied head's shared weight (the embedding's) halves once on each rank, its logits
    split, the embedding's lookups are summed in forward (a row-parallel layer's all-reduce) and the
    head's input gradient in backward (a column-parallel layer's)."""
    typed, model_cfg, split = resolved(*overrides)
    whole = dataclasses.replace(split, loss_parallel=False)
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs)
    assert probe.output_head == head and probe.for_plan(split) is probe.split_head
    hidden = OmegaConf.select(OmegaConf.create(model_cfg), hidden_key)
    weight = 4096 * hidden
    assert probe.output_head_params == weight
    _assert_split_saves_half_the_head(typed, workload, probe, split, whole, weight)
    assert describe_head(split, head).startswith(f"lm_head split over the vocabulary with its tied embedding "
                                                 f"{head.embedding}")
    model = count_model_cost(probe, [1, 2], probe.stats.param_count)
    tokens_hidden = workload.tokens_per_sample * hidden
    assert model.split_head.row_parallel_layers == model.row_parallel_layers + 1
    assert model.split_head.row_parallel_out_per_sample == model.row_parallel_out_per_sample + tokens_hidden
    assert model.split_head.column_parallel_layers == model.column_parallel_layers + 1
    assert model.split_head.column_parallel_in_per_sample == model.column_parallel_in_per_sample + tokens_hidden
    assert model.tp_param_count[2] - model.split_head.tp_param_count[2] == weight // 2


def test_a_tied_head_splits_its_embedding_with_it_and_the_embedding_all_reduces_its_lookups():
    """The built-in GPT's tied head (handed the embedding's weight at each call). With pipeline
    stages the first stage holds a copy of the weight as well: both copies split, each stage's
    parameters counted with half the embedding's rows (the engine's pairing of the copies is
    :func:`orch.launchers.engines.fsdp2.pipeline.held_parts_of_head`)."""
    overrides = ("model.vocab_size=4096", "plan.dp=1", "plan.tp=2", "plan.precision=fp32", "plan.engine=fsdp2")
    head = OutputHead("lm_head", 4096, "embed.wte")
    _assert_tied_head_splits(overrides, head, "d_model")
    typed, model_cfg, piped = resolved(*overrides, "plan.pp=2", "plan.grad_accum_steps=2",
                                       "cluster.devices_per_node=4")
    assert kept_whole(piped, head) is None and splits_head(piped, head)
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs,
                       pipeline_layers=workload.pipeline_layers)
    stages = estimate_plan(piped, typed.cluster, typed.optim, probe).pipeline
    whole = estimate_plan(dataclasses.replace(piped, loss_parallel=False), typed.cluster, typed.optim, probe).pipeline
    rows = 4096 * 128
    assert [s.tp_params - w.tp_params for s, w in zip(stages, whole, strict=True)] == [rows, rows]


def test_a_pipeline_rank_splits_every_copy_of_a_tied_head_it_holds():
    """The engine's pairing, by the stages' own names: each copy of a tied embedding (first and
    last stage) with the linear head of the same pipeline layer, if it has one."""
    from orch.launchers.engines.fsdp2.pipeline import held_parts_of_head

    hf = {"parts.0.layers.0.base.embed_tokens": "model.embed_tokens", "parts.0.layers.0.head.lm_head": "lm_head",
          "parts.0.layers.1.self_attn": "model.layers.0.self_attn",
          "parts.3.layers.2.base.embed_tokens": "model.embed_tokens", "parts.3.layers.2.head.lm_head": "lm_head"}
    assert held_parts_of_head(hf, OutputHead("lm_head", 4096, "model.embed_tokens")) == [
        OutputHead("parts.0.layers.0.head.lm_head", 4096, "parts.0.layers.0.base.embed_tokens"),
        OutputHead("parts.3.layers.2.head.lm_head", 4096, "parts.3.layers.2.base.embed_tokens")]
    gpt = {"parts.1.layers.0.wte": "embed.wte", "parts.1.layers.0.wpe": "embed.wpe"}
    assert held_parts_of_head(gpt, OutputHead("lm_head", 4096, "embed.wte")) == [
        OutputHead("", 4096, "parts.1.layers.0.wte")]
    untied = {"parts.1.layers.3.lm_head": "lm_head", "parts.1.layers.2.norm": "model.norm"}
    assert held_parts_of_head(untied, OutputHead("lm_head", 4096)) == [OutputHead("parts.1.layers.3.lm_head", 4096)]
    assert held_parts_of_head({"parts.0.layers.0.wte": "embed.wte"}, OutputHead("lm_head", 4096)) == []


def test_a_hugging_face_head_tied_to_its_embedding_splits_with_it():
    """A Hugging Face decoder with ``tie_word_embeddings`` (the shipped hf_causal_lm's default): its
    ``lm_head`` is a linear layer whose weight *is* the token embedding's, which the sharded probe's
    head holds the shard of too."""
    _assert_tied_head_splits(("model=hf_causal_lm", "model.config.vocab_size=4096", "plan.dp=1", "plan.tp=2",
                              "plan.precision=fp32", "plan.engine=fsdp2"),
                             OutputHead("lm_head", 4096, "model.embed_tokens"), "config.hidden_size")


def test_with_pipeline_stages_only_the_stage_that_holds_the_head_keeps_its_share():
    """At tp=2 x pp=2 the head's rows / tp count on the last stage, which holds it: not spread over
    the stages in proportion to their parameters as the other split layers' saving is."""
    overrides = (*UNTIED, "plan.engine=fsdp2", "plan.pp=2", "plan.grad_accum_steps=2", "cluster.devices_per_node=4")
    typed, model_cfg, split = resolved(*overrides)
    whole = dataclasses.replace(split, loss_parallel=False)
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs,
                       pipeline_layers=workload.pipeline_layers)
    whole_stages, split_stages = ([s.params for s in estimate_plan(plan, typed.cluster, typed.optim, probe).stages]
                   for plan in (whole, split))
    head_bytes = 4 * 4096 * 128
    # Over the stages, the split head saves half its fp32 weight, and the last stage most of that
    # (the other stages' split layers now keep a smaller share each, not diluted by a whole head).
    assert sum(whole_stages) - sum(split_stages) == pytest.approx(head_bytes // 2, abs=8)
    assert whole_stages[1] - split_stages[1] > 0.75 * head_bytes // 2 > whole_stages[0] - split_stages[0]
