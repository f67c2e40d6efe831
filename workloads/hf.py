"""Hugging Face causal language models: ``model=hf_causal_lm``.

Built from a config given as a dict (its ``model_type`` and sizes) or from a local directory
written by ``save_pretrained``; never downloaded at run time. Only safetensors weights are loaded:
a directory holding pickled ones (``pytorch_model.bin``), which unpickling could make run code,
is refused when the model is first built, in the driver's check, before any worker starts. The model declares its own
tensor-parallel plan (see :mod:`plans.tp_plan`) and supports ``gradient_checkpointing_enable()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workloads.local_files import missing_reason

PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Suffixes of weight files written by ``torch.save`` (pickles)."""


def hf_causal_lm(config: dict[str, Any] | None = None, pretrained_path: str | None = None) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if pretrained_path:
        if config:
            raise ValueError("model.config and model.pretrained_path are both set; set model.config=null to load "
                             f"{pretrained_path}, or model.pretrained_path=null to build from the config")
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
                         "model.pretrained_path to a local save_pretrained directory")
    arguments = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **arguments)
    except ValueError as error:
        raise ValueError(f"model.config.model_type={config['model_type']!r}: {error}") from None
    return AutoModelForCausalLM.from_config(hf_config)


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
