"""Pipeline stages of Hugging Face decoders: the structure read off models on ``meta``, the layers
computing what the model built whole computes, the planner's stages, then real DeepSpeed
pipelines of a Llama- and a Qwen2-shaped model on CPU workers in Ray actors."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.config import FAST, compose_config
from orch.checking import check_run
from orch.config import to_typed
from orch.plans.engines.deepspeed import kept_params
from orch.plans.errors import PipelineRefused, PlanError
from orch.plans.parallel.tp_plan import specs_from_tp_plan
from orch.workloads.hf import hf_causal_lm
from orch.workloads.hf_pipeline import detect_structure, pipeline_layers

SMALL = dict(vocab_size=256, max_position_embeddings=64)
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **SMALL),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **SMALL),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **SMALL),
    "gemma": dict(model_type="gemma", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, **SMALL),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, **SMALL),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=64,
                 bos_token_id=0, eos_token_id=0),
}
# What each architecture calls its parts: found, not listed, by detect_structure.
PARTS = {
    "llama": ("model", "embed_tokens", "layers", "norm", "lm_head", False),
    "qwen2": ("model", "embed_tokens", "layers", "norm", "lm_head", True),
    "mistral": ("model", "embed_tokens", "layers", "norm", "lm_head", False),
    "gemma": ("model", "embed_tokens", "layers", "norm", "lm_head", True),
    "gpt_neox": ("gpt_neox", "embed_in", "layers", "final_layer_norm", "lm_head", False),
    "gpt2": ("transformer", "wte", "h", "ln_f", "lm_head", True),
}


def on_meta(config: dict) -> torch.nn.Module:
    arguments = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **arguments))


# --- pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(PARTS))
def test_the_decoder_structure_is_found_in_each_architecture(arch):
    s = detect_structure(on_meta(CONFIGS[arch]))
    assert (s.base, s.embedding, s.layers, s.norm, s.head, s.tied) == PARTS[arch]
    assert s.depth == 3


def test_a_model_of_another_structure_is_refused_naming_what_it_lacks():
    # OPT keeps its embedding and layers one level further down (model.decoder).
    opt = dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
               word_embed_proj_dim=64, **SMALL)
    with pytest.raises(PipelineRefused, match=r"OPTModel has no input embedding \(get_input_embeddings\(\)\) of"):
        detect_structure(on_meta(opt))
    cfg = compose_config("model=hf_causal_lm", "model.config.model_type=opt", "++model.config.ffn_dim=256",
                         "++model.config.word_embed_proj_dim=128", "plan.pp=2", "plan.dp=1")
    with pytest.raises(PlanError) as info:
        check_run(*to_typed(cfg)[:2])
    violation = info.value.violations[0]
    assert violation.field == "plan.pp" and violation.value == 2
    assert ("cannot be split into pipeline stages by its pipeline_layers(): OPTModel has no input embedding"
            in violation.message)
    assert violation.fix.startswith("set plan.pp=1")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_pipeline_layers_start_from_the_weights_and_compute_the_logits_of_the_model_built_whole(arch):
    # Rotary cos/sin, sliding-window masks (Mistral), the embedding scale (Gemma), learned
    # positions (GPT-2) and tied heads (Qwen2, Gemma, GPT-2) all come out of the models' own code.
    config = CONFIGS[arch]
    torch.manual_seed(5)
    whole = hf_causal_lm(config=config).eval()
    torch.manual_seed(5)
    specs = pipeline_layers(config=config)
    layers = [spec.build().eval() for spec in specs]
    ids = torch.randint(0, 256, (2, 16))
    x = ids
    for spec, layer in zip(specs, layers, strict=True):
        x = spec.forward_fn(layer, x) if getattr(spec, "forward_fn", None) else layer(x)
    with torch.no_grad():
        expected = whole(ids).logits
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    assert [type(layer).__name__ for layer in layers[1:-2]] == ["DecoderLayer"] * 3


def test_a_decoder_layer_keeps_the_parameter_names_the_models_tensor_parallel_plan_matches():
    specs = specs_from_tp_plan(on_meta(CONFIGS["llama"]))
    with torch.device("meta"):
        layer = pipeline_layers(config=CONFIGS["llama"])[2].build()
    sharded = {name for name, _ in layer.named_parameters()
               if any(re.match(p, name) for spec in specs for p in spec["patterns"])}
    assert {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= sharded
    assert len(sharded) == 7  # q, k, v, o, gate, up, down


def test_a_pretrained_directory_is_not_pipelined():
    with pytest.raises(PipelineRefused, match=r"model.pretrained_path='/x'"):
        pipeline_layers(pretrained_path="/x")


LLAMA = ["model=hf_causal_lm", "model.config.hidden_size=64", "model.config.intermediate_size=128",
         "model.config.num_hidden_layers=4", "model.config.num_attention_heads=4",
         "model.config.num_key_value_heads=2", "model.config.tie_word_embeddings=false"]


def test_check_sizes_a_hugging_face_pipeline_stage_by_stage():
    typed, model_cfg, _ = to_typed(compose_config(*LLAMA, "plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=4"))
    estimate, _ = check_run(typed, model_cfg)
    stages = estimate.pipeline
    assert [layer for s in stages for layer in s.layers] == (["InputEmbedding"] + ["DecoderLayer"] * 4
                                                            + ["FinalNorm", "OutputHead"])
    assert [s.in_flight for s in stages] == [2, 1]  # 1F1B
    assert sum(s.params for s in stages) == estimate.model.param_count
    assert all(s.saved_bytes > 0 for s in stages)
    assert estimate.per_device.total == max(s.total for s in estimate.stages)


# --- real DeepSpeed pipelines in Ray actors ------------------------------------------------------


def train(sqlite_uri: str, *overrides: str):
    from orch.run.driver import run_training

    cfg = compose_config(*FAST, f"tracking.uri={sqlite_uri}", "train.steps=20", *overrides)
    return run_training(*to_typed(cfg))


PARITY = 1e-3  # as tests/test_pipeline.py: summation order only, amplified by Adam over the steps


@pytest.mark.slow
def test_a_llama_pipeline_follows_the_unpipelined_loss_curve(local_ray, sqlite_uri):
    # Same seed and global batch (8): dp=2 with a micro-batch of 4 per rank, and one pipeline
    # replica running two micro-batches of 4 through two stages (the same 8 samples).
    dp = train(sqlite_uri, *LLAMA, "plan.dp=2", "train.eval_batches=2")
    pp = train(sqlite_uri, *LLAMA, "plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2", "train.eval_batches=4")
    assert [f.model.params_on_rank for f in pp.worker_facts] == [s.params for s in pp.estimate.pipeline]
    losses = [r[0].loss for r in pp.reports]
    assert losses[-1] < losses[0] - 0.5
    assert losses == pytest.approx([r[0].loss for r in dp.reports], abs=PARITY)
    assert pp.eval_loss == pytest.approx(dp.eval_loss, abs=PARITY)


@pytest.mark.slow
def test_a_tied_qwen2_trains_in_two_stages_and_with_tensor_parallel_stages(local_ray, sqlite_uri):
    qwen2 = [*LLAMA[:6], "model.config.model_type=qwen2", "model.config.tie_word_embeddings=true",
             "plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2"]
    pp = train(sqlite_uri, *qwen2)
    grid = train(sqlite_uri, *qwen2, "plan.tp=2", "cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5")
    # The embedding's copy on the last stage is counted there too: one more embedding than the model.
    assert sum(f.model.params_on_rank for f in pp.worker_facts) == pp.estimate.model.param_count + 256 * 64
    assert all(f.model.params_on_rank < s.params for f, s in zip(grid.worker_facts[::2], grid.estimate.pipeline,
                                                                strict=True))
    # What AutoTP split on each stage is what the planner counts for it, layer by layer by the
    # whole model's names (the stage's own names differ: its layers are numbered in the stage).
    assert [f.model.params_on_rank for f in grid.worker_facts] == [
        kept_params(s.params, s.tp_params, 2) for s in grid.estimate.pipeline for _ in range(2)]
    losses = [r[0].loss for r in pp.reports]
    assert losses[-1] < losses[0] - 0.5
    assert [r[0].loss for r in grid.reports] == pytest.approx(losses, abs=PARITY)
