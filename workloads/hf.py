"""Hugging Face causal language models: ``model=hf_causal_lm`` and the shape presets (``model=llama3_8b``, ...).

Built from a config given as a dict (its ``model_type`` and sizes), from a Hugging Face
``config.json`` (``config_path``: the model that file describes, no weights), or from a local
directory written by ``save_pretrained``; never downloaded at run time. Only safetensors weights are loaded:
a directory holding pickled ones (``pytorch_model.bin``), which unpickling could make run code,
is refused when the model is first built, in the driver's check, before any worker starts. The model declares its own
tensor-parallel plan (see :mod:`plans.tp_plan`) and supports ``gradient_checkpointing_enable()``.
A decoder of the usual structure is split into pipeline stages by
:func:`workloads.hf_pipeline.pipeline_layers` (``hf_causal_lm.pipeline_layers``, where the
orchestrator looks for it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from workloads.hf_pipeline import pipeline_layers, seed_parts
from workloads.local_files import missing_reason

PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Suffixes of weight files written by ``torch.save`` (pickles)."""



def hf_causal_lm(config: dict[str, Any] | None = None, pretrained_path: str | None = None,
                 config_path: str | None = None) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sources = [name for name, value in (("model.config", config), ("model.pretrained_path", pretrained_path),
                                        ("model.config_path", config_path)) if value]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)} are {'both' if len(sources) == 2 else 'all'} set; the model is "
                         "built from one of them: set the others to null (model.config=null drops the small example "
                         "model=hf_causal_lm fills it with)")
    if config_path:
        return seed_parts(AutoModelForCausalLM.from_config(config_from_file(config_path)))
    if pretrained_path:
        _require_safetensors(pretrained_path)
        if torch.get_default_device().type == "meta":
            # The planner builds on meta, where there are no weights to load (transformers refuses
            # from_pretrained there): the saved config gives the same architecture.
            try:
                saved = AutoConfig.from_pretrained(pretrained_path, local_files_only=True)
            except (OSError, ValueError) as error:
                raise ValueError(f"model.pretrained_path={pretrained_path!r}: its config.json cannot be read "
                                 f"({' '.join(str(error).split())[:200]})") from None
            return AutoModelForCausalLM.from_config(saved)
        return AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True, use_safetensors=True)
    if not config or "model_type" not in config:
        raise ValueError("model.config needs a model_type (e.g. llama, gpt2) and the model's sizes, or set "
                         "model.config_path to a Hugging Face config.json, or model.pretrained_path to a local "
                         "save_pretrained directory")
    arguments = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **arguments)
    except ValueError as error:
        raise ValueError(f"model.config.model_type={config['model_type']!r}: {error}") from None
    # Each part initialized from a seed of its own, as its pipeline layer is (equal losses at any plan.pp).
    return seed_parts(AutoModelForCausalLM.from_config(hf_config))


def config_from_file(config_path: str):
    """The transformers config a ``config.json`` (or a directory holding one) describes.

    Read by ``AutoConfig.from_pretrained``, so every key the file leaves out takes its model
    type's own default, as when the model is loaded from the Hub. Local files only: a path that
    does not exist is refused here instead of being taken for a Hub repository id.
    """
    from transformers import AutoConfig

    path = Path(config_path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no config.json" if path.is_dir() else f"{path} does not exist"
        raise ValueError(f"model.config_path={config_path!r}: {where}; give a Hugging Face config.json (or the "
                         "directory holding it)")
    try:
        declared = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"model.config_path={config_path!r} is not a readable JSON file ({error}); give a "
                         "Hugging Face config.json") from None
    if not isinstance(declared, dict) or not isinstance(declared.get("model_type"), str):
        raise ValueError(f"model.config_path={config_path!r} has no \"model_type\" key (llama, qwen2, mistral, ...): "
                         "a Hugging Face config.json names the architecture it describes")
    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"model.config_path={config_path!r}: transformers cannot read it as a config "
                         f"({error})") from None


def _require_safetensors(pretrained_path: str) -> None:
    """Refuse a ``pretrained_path`` that is not a directory of safetensors weights, naming the field."""
    directory = Path(pretrained_path).expanduser()
    if not directory.is_dir():
        what = (missing_reason(directory) or "is not a directory.").rstrip(".")
        raise ValueError(f"model.pretrained_path={pretrained_path!r} {what}: give the directory save_pretrained "
                         "wrote (config.json and model.safetensors)")
    names = sorted(p.name for p in directory.iterdir())
    if any(name.endswith(".safetensors") for name in names):
        return
    pickled = [name for name in names if name.endswith(PICKLED_WEIGHTS)]
    if pickled:
        raise ValueError(f"model.pretrained_path={pretrained_path!r} holds pickled weights ({', '.join(pickled[:3])}), "
                         "which are never loaded: unpickling can run code. Convert them to safetensors where you "
                         "trust them (`model.save_pretrained(DIR)` writes model.safetensors) and point "
                         "model.pretrained_path there")
    raise ValueError(f"model.pretrained_path={pretrained_path!r} holds no weights (no *.safetensors file): give "
                     "the directory save_pretrained wrote")


hf_causal_lm.pipeline_layers = pipeline_layers
