"""A model's pipeline stages described without an engine (orch/plans/parallel/stage_layers.py), and their
translation into DeepSpeed's pipeline layers; pure, no Ray and no process group."""

from __future__ import annotations

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from helpers.config import compose_config, lm_inputs
from orch.checking import check_run
from orch.config import to_typed
from orch.launchers.engines.deepspeed.building import deepspeed_layers
from orch.plans.engines import engine_spec
from orch.plans.errors import PlanError
from orch.plans.parallel.pipeline import measure_pipeline_layers
from orch.plans.parallel.stage_layers import StageLayer
from orch.workloads.gpt import GPT, Block, Embedding, LMHead, layer_seed, tied_logits

SMALL = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16}


class LayerSpecGPT(GPT):
    """A model written against DeepSpeed: its ``pipeline_layers()`` returns DeepSpeed's own specs."""

    @classmethod
    def pipeline_layers(cls, **arguments) -> list:
        return [_as_layer_spec(layer) for layer in GPT.pipeline_layers(**arguments)]


class FunctionBuiltGPT(GPT):
    """A model whose final norm is built by a function, which DeepSpeed's pipeline cannot take."""

    @classmethod
    def pipeline_layers(cls, **arguments) -> list:
        layers = GPT.pipeline_layers(**arguments)
        layers[-2] = StageLayer.of(_layer_norm, *layers[-2].args)
        return layers


def _layer_norm(width: int) -> nn.Module:
    return nn.LayerNorm(width)


def _as_layer_spec(layer: StageLayer) -> LayerSpec:
    if layer.tie is None:
        return LayerSpec(layer.module, *layer.args, **layer.kwargs)
    return TiedLayerSpec(layer.tie, layer.module, *layer.args, forward_fn=layer.forward_fn,
                         tied_weight_attr=layer.tied_weight_attr, **layer.kwargs)


def test_the_gpt_describes_its_layers_with_the_embedding_and_the_tied_head_sharing_one_key():
    torch.manual_seed(3)
    layers = GPT.pipeline_layers(**SMALL)
    assert all(isinstance(layer, StageLayer) for layer in layers)
    assert [layer.module for layer in layers] == [Embedding, Block, Block, nn.LayerNorm, Embedding]
    first, head = layers[0], layers[-1]
    assert first.tie == head.tie == "embed" and first.tied_weight_attr == head.tied_weight_attr == "wte.weight"
    assert first.forward_fn is None and head.forward_fn is tied_logits
    assert first.args == head.args == (256, 16, 32)
    assert first.kwargs == head.kwargs == {"init_seed": layer_seed(3, 0)}
    assert layers[2].args == (32, 2) and layers[2].kwargs["init_seed"] == layer_seed(3, 2)
    assert [layer.tie for layer in layers[1:-1]] == [None] * 3
    # Where each layer's state sits in the whole GPT (the fsdp2 pipeline saves under those names).
    assert [dict(layer.names) for layer in layers] == [{"": "embed."}, {"": "blocks.0."}, {"": "blocks.1."},
                                                       {"": "ln_f."}, {"": "embed."}]


def test_an_untied_gpt_head_is_a_layer_of_its_own():
    torch.manual_seed(3)
    head = GPT.pipeline_layers(**SMALL, tie_embeddings=False)[-1]
    assert head == StageLayer(module=LMHead, args=(32, 256), kwargs={"init_seed": layer_seed(3, 4)},
                              names={"": "lm_head."})


def test_deepspeed_gets_its_own_specs_with_the_same_classes_arguments_and_tie_keys():
    layers = GPT.pipeline_layers(**SMALL)
    specs = deepspeed_layers(layers)
    assert [type(spec) for spec in specs] == [TiedLayerSpec, LayerSpec, LayerSpec, LayerSpec, TiedLayerSpec]
    for layer, spec in zip(layers, specs, strict=True):
        assert (spec.typename, spec.module_args, spec.module_kwargs) == (layer.module, layer.args, layer.kwargs)
    assert specs[0].key == specs[-1].key == "embed"
    assert specs[0].tied_weight_attr == specs[-1].tied_weight_attr == ["wte.weight"]
    assert specs[0].forward_fn is None and specs[-1].forward_fn is tied_logits


def test_deepspeed_specs_and_modules_a_model_returns_itself_pass_through_unchanged():
    own = [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), TiedLayerSpec("t", nn.Linear, 4, 4)]
    assert all(a is b for a, b in zip(deepspeed_layers(own), own, strict=True))


def test_a_layer_built_by_a_function_is_measured_but_refused_by_deepspeed():
    """The planner builds it; DeepSpeed's spec refuses it before any worker starts (`orch check`),
    and its engine again if a job carries it anyway."""
    def linear(width: int) -> nn.Module:
        return nn.Linear(width, width)

    layer = StageLayer.of(linear, 8)
    with torch.device("meta"):
        assert isinstance(layer.build(), nn.Linear)
    problem = engine_spec("deepspeed").pipeline_layer_problem([StageLayer.of(nn.Linear, 8, 8), layer])
    assert problem == ("layer 1 (linear) is built by a function, and DeepSpeed's pipeline builds layers from "
                       "nn.Module classes only")
    assert engine_spec("deepspeed").pipeline_layer_problem(GPT.pipeline_layers(n_layer=2)) is None
    with pytest.raises(TypeError, match=r"pipeline layer 0 \(linear\) is built by a function"):
        deepspeed_layers([layer])


def test_a_forward_fn_without_a_tie_is_refused():
    with pytest.raises(ValueError, match=r"StageLayer\(Embedding\) has a forward_fn but no tie"):
        StageLayer.of(Embedding, 256, 16, 32, forward_fn=tied_logits)


def test_the_planner_measures_deepspeed_specs_as_it_measures_stage_layers():
    torch.manual_seed(3)
    ours = measure_pipeline_layers(GPT.pipeline_layers(**SMALL), micro_batch_size=2, inputs=lm_inputs(16),
                                   dtype=torch.float32)
    torch.manual_seed(3)
    theirs = measure_pipeline_layers(LayerSpecGPT.pipeline_layers(**SMALL), micro_batch_size=2,
                                     inputs=lm_inputs(16), dtype=torch.float32)
    assert theirs == ours


def test_check_plans_a_model_whose_pipeline_layers_are_deepspeed_specs():
    def stages(target: str):
        cfg = compose_config("plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=2", f"model._target_={target}")
        return check_run(*to_typed(cfg)[:2])[0].stages

    assert stages("test_stage_layers.LayerSpecGPT") == stages("orch.workloads.gpt.GPT")


def test_check_refuses_a_pipeline_layer_deepspeed_cannot_build_before_any_worker_starts():
    cfg = compose_config("plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=2",
                         "model._target_=test_stage_layers.FunctionBuiltGPT")
    with pytest.raises(PlanError) as refused:
        check_run(*to_typed(cfg)[:2])
    assert str(refused.value.violations[0]) == (
        "plan.pp=2: test_stage_layers.FunctionBuiltGPT's pipeline_layers(): layer 3 (_layer_norm) is built by a "
        "function, and DeepSpeed's pipeline builds layers from nn.Module classes only. Fix: give each StageLayer the "
        "module's class (its arguments in args and kwargs), or set plan.pp=1")
