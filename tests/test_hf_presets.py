"""Models from a Hugging Face config.json alone (``model.config_path``) and the shipped presets:
their published parameter counts, built on meta, and `orch check` of an 8K-sequence Llama 3 8B."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.config import compose_config
from orch.checking import check_run
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.model.meta import meta_device
from orch.workloads.hf import config_from_file, hf_causal_lm
from orch.workloads.hf_presets import PRESETS_DIR, preset_config_path

# The parameter counts the models' authors publish (model cards and safetensors metadata).
PUBLISHED = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800,
             "qwen2_5_7b": 7_615_616_512, "qwen2_5_72b": 72_706_203_648, "mistral_7b": 7_241_732_096}

# Llama 3 8B's sizes alone: every other key is left to the llama model type's defaults.
LLAMA3_8B_SIZES = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}


def check(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return check_run(typed, model_cfg)


def distinct_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_preset_builds_its_published_parameter_count(name):
    with meta_device():
        model = AutoModelForCausalLM.from_config(config_from_file(preset_config_path(name)))
    assert distinct_params(model) == PUBLISHED[name]


def test_every_shipped_config_has_a_model_preset():
    assert sorted(p.stem for p in PRESETS_DIR.glob("*.json")) == sorted(PUBLISHED)
    for name in PUBLISHED:
        assert compose_config(f"model={name}").model.config_path == preset_config_path(name)


def test_keys_the_file_leaves_out_take_the_model_types_defaults(tmp_path):
    """Not the shipped example's: model=hf_causal_lm ties its embeddings, Llama's default does not."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_SIZES))
    with meta_device():
        from_file = hf_causal_lm(config_path=str(tmp_path))  # the directory holding config.json works too
    assert distinct_params(from_file) == PUBLISHED["llama3_8b"]
    _, facts = check("model=hf_causal_lm", "model.config=null", f"model.config_path={path}", "cluster=a100_8x",
                     "plan.zero_stage=3")
    assert facts.param_count == PUBLISHED["llama3_8b"]


@pytest.mark.parametrize(("content", "expected"), [
    (None, "does not exist"),
    ("{not json", "is not a readable JSON file"),
    ('{"hidden_size": 64}', 'has no "model_type" key'),
    ('{"model_type": "no_such_model"}', "transformers cannot read it as a config"),
])
def test_a_missing_or_malformed_config_path_is_refused_naming_the_field(tmp_path, content, expected):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlanError) as info:
        check("model=hf_causal_lm", "model.config=null", f"model.config_path={path}")
    assert f"model.config_path={str(path)!r}" in str(info.value) and expected in str(info.value)


def test_config_path_beside_the_examples_config_is_refused_naming_both():
    """Set together where no command line says which is meant (a config composed in code, or a
    user's own file): `orch` on the command line lets model.config_path win (test_hf_model_sources)."""
    with pytest.raises(PlanError) as info:
        check("model=hf_causal_lm", f"model.config_path={preset_config_path('llama3_8b')}")
    assert "model.config and model.config_path are both set" in str(info.value)
    assert "model.config=null" in str(info.value)


def test_llama3_8b_at_8k_tokens_fits_80gb_gpus_at_tp4_without_checkpointing():
    """Counted with the flash kernel the GPUs run, a tp=4 rank holds ~36 GiB of activations at
    sequence 8192 and micro-batch 1 (the math path's scores made it ~102 GiB): the layout fits."""
    estimate, facts = check("model=llama3_8b", "cluster=a100_8x", "plan.tp=4", "plan.zero_stage=1",
                            "plan.micro_batch_size=1", "plan.precision=bf16", "data.seq_len=8192")
    assert facts.param_count == PUBLISHED["llama3_8b"]
    assert estimate.attention.startswith("scaled_dot_product_attention on gpu: flash kernel")
    assert estimate.per_device.activations < 40 * 2**30
    assert estimate.feasible, estimate.violations
