"""DeepSpeed's AutoTP presets as layer-spec dicts.

A model that declares no tensor-parallel plan may still be one of the architectures DeepSpeed
ships AutoTP presets for (``AutoTPPresets``: BLOOM, ChatGLM, Qwen2, ...), found by the
``model_type`` of its Hugging Face config. The preset's specs are written out as the dicts
``tensor_parallel.partition_config`` takes (:mod:`orch.plans.parallel.tp_plan`), so the planner counts the
parameters they shard and ``orch check`` verifies that they match the model's parameters, whichever
engine then trains them.
"""

from __future__ import annotations

import torch


def specs_from_deepspeed_preset(module: torch.nn.Module) -> tuple[list[dict], str] | None:
    """DeepSpeed's AutoTP preset for ``module``'s architecture (its config's ``model_type``) as
    layer-spec dicts, and the preset's name; None when DeepSpeed has none for it."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        return None
    from deepspeed.module_inject.autotp_config import AutoTPPresets, PartitionType

    preset = AutoTPPresets.get_preset(model_type)
    if preset is None:
        return None
    specs = []
    for spec in preset.layer_specs:
        if spec.partition_type == PartitionType.SKIP:
            continue
        entry: dict = {"patterns": list(spec.patterns), "partition_type": spec.partition_type.value}
        if spec.shape is not None:
            entry["shape"] = _as_lists(spec.shape)
        if spec.partition_dim is not None:
            entry["partition_dim"] = spec.partition_dim
        if spec.gather_output:
            entry["gather_output"] = True
        specs.append(entry)
    return (specs, model_type) if specs else None


def _as_lists(shape):
    """A preset's shape (nested tuples) as the JSON lists ``tensor_parallel.partition_config`` takes."""
    return [_as_lists(part) if isinstance(part, (tuple, list)) else part for part in shape]
