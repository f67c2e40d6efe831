"""DeepSpeed AutoTP layer specs from a model's own tensor-parallel plan, or DeepSpeed's preset for it.

Hugging Face models declare how they shard (``model._tp_plan``, built from the config's
``base_model_tp_plan``): module-name patterns with ``*`` for a layer index, each mapped to a
style. The column- and row-parallel linear layers become AutoTP ``layer_specs`` (regexes of
parameter names, as ``tensor_parallel.partition_config`` takes them). Embeddings and the
output head stay replicated, as they do for the built-in GPT: their styles
(``embedding_rowwise``, ``colwise_gather_output``) have no AutoTP counterpart here.

A model that declares no plan may still be one of the architectures DeepSpeed ships AutoTP
presets for (:mod:`orch.plans.engines.deepspeed_autotp`).
"""

from __future__ import annotations

import re

import torch

_STYLES = {"colwise": "column", "rowwise": "row"}


def layer_kinds(module: torch.nn.Module, layer_specs: list[dict],
                match_names: dict[str, str] | None = None) -> dict[str, str]:
    """Module name -> partition type ('column', 'row', 'skip') for each module of ``module`` whose
    ``weight`` is a parameter that an AutoTP layer spec names.

    As in DeepSpeed's AutoTP, a spec's patterns are regexes matched at the start of
    ``<module>.weight``, a spec without ``partition_type`` is column-parallel, and the first
    matching pattern, in spec order, decides. ``match_names`` (module name -> the name to match,
    a pipeline stage's layers by the whole model's names) renames before matching.
    """
    patterns = [(re.compile(p), spec.get("partition_type", "column"))
                for spec in layer_specs for p in spec.get("patterns", [])]
    kinds: dict[str, str] = {}
    for name, layer in module.named_modules():
        if not isinstance(getattr(layer, "weight", None), torch.nn.Parameter):
            continue
        matched_name = (match_names or {}).get(name, name)
        matched = [kind for pattern, kind in patterns if pattern.match(f"{matched_name}.weight")]
        if matched:
            kinds[name] = matched[0]
    return kinds


def split_layers(module: torch.nn.Module, layer_specs: list[dict],
                 match_names: dict[str, str] | None = None) -> dict[str, str]:
    """Module name -> 'column' or 'row' for the layers tensor parallelism splits: those
    :func:`layer_kinds` finds, less the ones their spec skips and any whose weight is not a matrix."""
    return {name: kind for name, kind in layer_kinds(module, layer_specs, match_names).items()
            if kind != "skip" and module.get_submodule(name).weight.dim() == 2}


def split_params(module: torch.nn.Module, layer_specs: list[dict],
                 match_names: dict[str, str] | None = None) -> tuple[int, int]:
    """(all, trainable) parameters of ``module`` the layer specs split: a column-parallel layer's
    weight and bias, a row-parallel layer's weight (its bias stays whole), as DeepSpeed's
    LinearLayer / LinearAllreduce and DTensor's styles keep them."""
    sharded, trainable = 0, 0
    for name, kind in split_layers(module, layer_specs, match_names).items():
        layer = module.get_submodule(name)
        params = [layer.weight]
        bias = getattr(layer, "bias", None)
        if kind == "column" and isinstance(bias, torch.nn.Parameter):
            params.append(bias)
        sharded += sum(p.numel() for p in params)
        trainable += sum(p.numel() for p in params if p.requires_grad)
    return sharded, trainable


# The size attributes DeepSpeed's AutoTP divides by tp on every module above a sharded layer
# (``AutoTP.update_mp_params``), so code that reshapes by its head count sees its own share.
_TP_SIZE_ATTRIBUTES = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads",
                       "all_head_size", "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads",
                       "kv_n_heads", "d_model")


def shard_module(module: torch.nn.Module, layer_specs: list[dict], tp: int,
                 match_names: dict[str, str] | None = None) -> torch.nn.Module:
    """``module`` (on ``meta``) as one tensor-parallel rank holds it, changed in place and returned:
    every layer an AutoTP spec names gets the shapes of its shard (column-parallel: output rows / tp, with its bias;
    row-parallel: input columns / tp, bias whole), as DeepSpeed's LinearLayer and LinearAllreduce
    keep them. Running the model's own forward on it gives the activations of one rank: the
    sharded layers' outputs and inputs shrink by tp, the rest stay whole (the row-parallel
    all-reduce changes values, not shapes, so it is not needed on meta)."""
    sharded: list[str] = []
    # id of a split layer's whole weight -> (that weight, held so that its id is not reused; its shard)
    shards: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    for name, kind in split_layers(module, layer_specs, match_names).items():
        layer = module.get_submodule(name)
        weight = layer.weight
        rows, cols = weight.shape
        if kind == "column":
            layer.weight = torch.nn.Parameter(torch.empty(rows // tp, cols, device="meta", dtype=weight.dtype))
            if isinstance(getattr(layer, "bias", None), torch.nn.Parameter):
                layer.bias = torch.nn.Parameter(torch.empty(rows // tp, device="meta", dtype=weight.dtype))
        else:
            layer.weight = torch.nn.Parameter(torch.empty(rows, cols // tp, device="meta", dtype=weight.dtype))
        shards[id(weight)] = (weight, layer.weight)
        sharded.append(name)
    # A layer sharing a split layer's weight (a linear head tied to its embedding) holds the same shard.
    for owner in module.modules():
        weight = getattr(owner, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and shards.get(id(weight), (None,))[0] is weight:
            owner.weight = shards[id(weight)][1]
    for name, owner in module.named_modules():
        if name and any(layer.startswith(f"{name}.") for layer in sharded):
            for attribute in _TP_SIZE_ATTRIBUTES:
                value = getattr(owner, attribute, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                    setattr(owner, attribute, value // tp)
    return module


def _pattern(module_pattern: str) -> str:
    body = r"\d+".join(re.escape(part) for part in module_pattern.split("*"))
    return rf"(^|.*\.){body}\.weight$"


def specs_from_tp_plan(module: torch.nn.Module) -> list[dict] | None:
    """The AutoTP layer specs of ``module``'s own plan; None when it declares none (or none of its
    entries shards a linear layer)."""
    plan = getattr(module, "_tp_plan", None) or getattr(module, "tp_plan", None)
    if not isinstance(plan, dict):
        return None
    grouped: dict[str, list[str]] = {}
    for name, style in plan.items():
        kind = _STYLES.get(style)
        if kind is not None:
            grouped.setdefault(kind, []).append(_pattern(name))
    if not grouped:
        return None
    return [{"patterns": patterns, "partition_type": kind} for kind, patterns in sorted(grouped.items())]
