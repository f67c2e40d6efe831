"""Hugging Face causal language models: ``model=hf_causal_lm``.

Built from a config given as a dict (its ``model_type`` and sizes) or from a local directory
written by ``save_pretrained``; never downloaded at run time. The model declares its own
tensor-parallel plan (see :mod:`plans.tp_plan`) and supports ``gradient_checkpointing_enable()``.
A decoder of the usual structure is split into pipeline stages by
:func:`workloads.hf_pipeline.pipeline_layers` (``hf_causal_lm.pipeline_layers``, where the
orchestrator looks for it).
"""

from __future__ import annotations

from typing import Any

import torch

from workloads.hf_pipeline import pipeline_layers, seed_parts


def hf_causal_lm(config: dict[str, Any] | None = None, pretrained_path: str | None = None) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if pretrained_path:
        if config:
            raise ValueError("model.config and model.pretrained_path are both set; set model.config=null to load "
                             f"{pretrained_path}, or model.pretrained_path=null to build from the config")
        if torch.get_default_device().type == "meta":
            # The planner builds on meta, where there are no weights to load (transformers refuses
            # from_pretrained there): the saved config gives the same architecture.
            saved = AutoConfig.from_pretrained(pretrained_path, local_files_only=True)
            return AutoModelForCausalLM.from_config(saved)
        return AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True)
    if not config or "model_type" not in config:
        raise ValueError("model.config needs a model_type (e.g. llama, gpt2) and the model's sizes, or set "
                         "model.pretrained_path to a local save_pretrained directory")
    arguments = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **arguments)
    except ValueError as error:
        raise ValueError(f"model.config.model_type={config['model_type']!r}: {error}") from None
    # Each part initialized from a seed of its own, as its pipeline layer is (equal losses at any plan.pp).
    return seed_parts(AutoModelForCausalLM.from_config(hf_config))


hf_causal_lm.pipeline_layers = pipeline_layers
