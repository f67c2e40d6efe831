"""Hugging Face causal language models: ``model=hf_causal_lm`` and the shape presets (``model=llama3_8b``, ...).

Built from a config given as a dict (its ``model_type`` and sizes), from a Hugging Face
``config.json`` (``config_path``: the model that file describes, no weights), or from a local
directory written by ``save_pretrained``; never downloaded at run time. Only safetensors weights are loaded:
a directory holding pickled ones (``pytorch_model.bin``), which unpickling could make run code,
or a safetensors file cut short, is refused when the model is first built, in the driver's check,
before any worker starts. Only model types transformers ships are built: a config whose
``auto_map`` points at code of its own is refused before transformers could ask on the terminal
whether to run it (:func:`_refuse_custom_code`). A deep model's depth is declared to the planner
(:func:`declared_depth`), which builds two shallow copies instead of it. The model declares its own
tensor-parallel plan (see :mod:`orch.plans.parallel.tp_plan`) and supports ``gradient_checkpointing_enable()``.
A decoder of the usual structure is split into pipeline stages by
:func:`orch.workloads.hf_pipeline.pipeline_layers` (``hf_causal_lm.pipeline_layers``, where the
orchestrator looks for it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from orch.plans.errors import PlanError, Violation
from orch.plans.model.depth_scaling import DeclaredDepth
from orch.workloads.hf_pipeline import pipeline_layers, seed_parts
from orch.workloads.local_files import missing_reason

PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Suffixes of weight files written by ``torch.save`` (pickles)."""

SHARD_INDEX = "model.safetensors.index.json"
"""The file ``save_pretrained`` writes beside sharded safetensors weights: which shard holds each tensor."""

DEPTH_ATTRIBUTE = "num_hidden_layers"
"""The transformers config attribute for the number of decoder layers (GPT-2's ``n_layer`` maps to it)."""

_SOURCES = ("config", "pretrained_path", "config_path")


def hf_causal_lm(config: dict[str, Any] | None = None, pretrained_path: str | None = None,
                 config_path: str | None = None) -> torch.nn.Module:
    """The causal LM of a transformers config; only model types transformers ships are built
    (``trust_remote_code=False``: a directory's own Python is never run, nor asked about)."""
    from transformers import AutoModelForCausalLM

    _one_source(config, pretrained_path, config_path)
    if config_path:
        return seed_parts(AutoModelForCausalLM.from_config(config_from_file(config_path), trust_remote_code=False))
    if pretrained_path:
        saved = pretrained_config(pretrained_path)
        if torch.get_default_device().type == "meta":
            # The planner builds on meta, where there are no weights to load (transformers refuses
            # from_pretrained there): the saved config gives the same architecture.
            return AutoModelForCausalLM.from_config(saved, trust_remote_code=False)
        return AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True, use_safetensors=True,
                                                    trust_remote_code=False)
    # Each part initialized from a seed of its own, as its pipeline layer is (equal losses at any plan.pp).
    return seed_parts(AutoModelForCausalLM.from_config(_config_from_dict(config), trust_remote_code=False))


def _one_source(config, pretrained_path, config_path) -> None:
    sources = [f"model.{name}" for name, value in zip(_SOURCES, (config, pretrained_path, config_path), strict=True)
               if value]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)} are {'both' if len(sources) == 2 else 'all'} set; the model is "
                         "built from one of them: set the others to null (model.config=null drops the small example "
                         "model=hf_causal_lm fills it with)")


def _config_from_dict(config: dict[str, Any] | None):
    from transformers import AutoConfig

    if not config or "model_type" not in config:
        raise ValueError("model.config needs a model_type (e.g. llama, gpt2) and the model's sizes, or set "
                         "model.config_path to a Hugging Face config.json, or model.pretrained_path to a local "
                         "save_pretrained directory")
    arguments = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config["model_type"], **arguments)
    except ValueError as error:
        raise ValueError(f"model.config.model_type={config['model_type']!r}: {error}") from None


def config_from_file(config_path: str):
    """The transformers config a ``config.json`` (or a directory holding one) describes.

    Read by ``AutoConfig.from_pretrained``, so every key the file leaves out takes its model
    type's own default, as when the model is loaded from the Hub. Local files only: a path that
    does not exist is refused here instead of being taken for a Hub repository id.
    """
    file, _ = _config_file_json(config_path)
    return _read_config(file, "model.config_path", config_path)


def _config_file_json(config_path: str) -> tuple[Path, dict[str, Any]]:
    """``model.config_path``'s file and its keys, refused unless it is a config of a model type
    transformers ships (:func:`_refuse_custom_code`)."""
    path = Path(config_path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no config.json" if path.is_dir() else f"{path} does not exist"
        raise ValueError(f"model.config_path={config_path!r}: {where}; give a Hugging Face config.json (or the "
                         "directory holding it)")
    return file, _config_json(file, "model.config_path", config_path)


def _config_json(file: Path, field: str, value: str) -> dict[str, Any]:
    """The keys of a ``config.json``, refused with ``field`` named unless it is a config of a
    model type transformers ships."""
    try:
        declared = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{field}={value!r}: {file} is not a readable JSON file ({error}); give a "
                         "Hugging Face config.json") from None
    if not isinstance(declared, dict) or not isinstance(declared.get("model_type"), str):
        raise ValueError(f"{field}={value!r}: {file} has no \"model_type\" key (llama, qwen2, mistral, ...): "
                         "a Hugging Face config.json names the architecture it describes")
    _refuse_custom_code(declared, file, field, value)
    return declared


def _refuse_custom_code(declared: dict[str, Any], file: Path, field: str, value: str) -> None:
    """Refuse a config whose model type transformers does not ship and whose ``auto_map`` names
    code beside it: transformers would ask on the terminal whether to run that code (or, told
    not to, refuse in its own words). A model type it ships is built by transformers' own class,
    whatever ``auto_map`` says."""
    from transformers import CONFIG_MAPPING

    auto_map = declared.get("auto_map")
    if not auto_map or declared["model_type"] in CONFIG_MAPPING:
        return
    entries = json.dumps(auto_map)
    entries = entries if len(entries) <= 300 else entries[:300] + "..."
    raise PlanError([Violation(
        field, value,
        f"{file} declares model_type {declared['model_type']!r}, which transformers does not ship, and code of its "
        f"own to build it (\"auto_map\": {entries}). orch never runs a model directory's code (trust_remote_code "
        "stays off): it builds the model types transformers ships.",
        "give a config of one of those (model_type llama, qwen2, mistral, gpt2, ...), or train your own model as "
        "your own torch.nn.Module class (model._target_=your_module.YourModel and its arguments: see "
        "docs/workloads.md, \"Your own pieces\")")])


def _read_config(source: Path, field: str, value: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{field}={value!r}: transformers cannot read it as a config "
                         f"({' '.join(str(error).split())[:300]})") from None


def pretrained_config(pretrained_path: str):
    """The transformers config of a ``save_pretrained`` directory, once its weights are known to
    be whole safetensors files (:func:`_require_safetensors`)."""
    directory = _require_safetensors(pretrained_path)
    file = directory / "config.json"
    if not file.is_file():
        raise ValueError(f"model.pretrained_path={pretrained_path!r} holds no config.json: give the directory "
                         "save_pretrained wrote")
    _config_json(file, "model.pretrained_path", pretrained_path)
    return _read_config(directory, "model.pretrained_path", pretrained_path)


def _require_safetensors(pretrained_path: str) -> Path:
    """The directory ``pretrained_path`` names, refused (naming the field) unless it holds
    safetensors weights, each of them whole."""
    directory = Path(pretrained_path).expanduser()
    if not directory.is_dir():
        what = (missing_reason(directory) or "is not a directory.").rstrip(".")
        raise ValueError(f"model.pretrained_path={pretrained_path!r} {what}: give the directory save_pretrained "
                         "wrote (config.json and model.safetensors)")
    names = sorted(p.name for p in directory.iterdir())
    weights = [name for name in names if name.endswith(".safetensors")]
    if weights:
        _require_listed_shards(directory, pretrained_path)
        for name in weights:
            _require_whole_safetensors(directory / name, pretrained_path)
        return directory
    pickled = [name for name in names if name.endswith(PICKLED_WEIGHTS)]
    if pickled:
        raise ValueError(f"model.pretrained_path={pretrained_path!r} holds pickled weights ({', '.join(pickled[:3])}), "
                         "which are never loaded: unpickling can run code. Convert them to safetensors where you "
                         "trust them (`model.save_pretrained(DIR)` writes model.safetensors) and point "
                         "model.pretrained_path there")
    raise ValueError(f"model.pretrained_path={pretrained_path!r} holds no weights (no *.safetensors file): give "
                     "the directory save_pretrained wrote")


def _require_whole_safetensors(file: Path, pretrained_path: str) -> None:
    """Refuse a safetensors file whose header cannot be read or whose tensors' data does not
    exactly fill the file (one cut short by a copy): safetensors' own reader checks both, from
    the header alone, so the driver refuses what the workers would fail to load."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        raise PlanError([Violation(
            "model.pretrained_path", pretrained_path,
            f"{file} ({file.stat().st_size:,} bytes) is not a whole safetensors file: "
            f"{' '.join(str(error).split())[:200]}. It was cut short, or is not safetensors; the workers could not "
            "load it.",
            "copy the file again, or write the directory again with save_pretrained")]) from None


def _require_listed_shards(directory: Path, pretrained_path: str) -> None:
    """Refuse sharded weights whose index (:data:`SHARD_INDEX`) names a shard the directory lacks."""
    index = directory / SHARD_INDEX
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"model.pretrained_path={pretrained_path!r}: {SHARD_INDEX} is not readable JSON ({error}): "
                         "write the directory again with save_pretrained") from None
    missing = sorted({str(name) for name in weight_map.values()} - {p.name for p in directory.iterdir()})
    if missing:
        raise ValueError(f"model.pretrained_path={pretrained_path!r}: {SHARD_INDEX} lists shard(s) the directory "
                         f"lacks ({', '.join(missing[:3])}): copy them, or write the directory again with "
                         "save_pretrained")


def declared_depth(config: dict[str, Any] | None = None, pretrained_path: str | None = None,
                   config_path: str | None = None) -> DeclaredDepth | None:
    """The model's number of decoder layers (its config's ``num_hidden_layers``), where the
    user sets it, and the same model's arguments at any other depth: what the planner builds a
    deep model's two shallow copies from instead of the model itself (``orch check`` of 2000
    layers then builds 2 and 4).

    The copies are built from the config's keys as a dict (``model.config``), whichever way the
    config was given. Lists of one entry per layer (``layer_types``) are cut to the copy's depth
    when every entry is the same; a config whose layers differ gives None (built in full).
    """
    _one_source(config, pretrained_path, config_path)
    if config_path:
        file, declared = _config_file_json(config_path)
        built, field, value = _read_config(file, "model.config_path", config_path), "model.config_path", config_path
    elif pretrained_path:
        built, field, value = pretrained_config(pretrained_path), "model.pretrained_path", pretrained_path
        file = Path(pretrained_path).expanduser() / "config.json"
        declared = json.loads(file.read_text())
    else:
        built, declared, file = _config_from_dict(config), dict(config), None
    layers = getattr(built, DEPTH_ATTRIBUTE, None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return None
    names = [DEPTH_ATTRIBUTE, type(built).attribute_map.get(DEPTH_ATTRIBUTE, DEPTH_ATTRIBUTE)]
    key = next((name for name in names if name in declared), names[-1])
    per_layer = {name: entries for name, entries in vars(built).items()
                 if isinstance(entries, list) and len(entries) == layers and layers > 1}
    if any(entries.count(entries[0]) != layers for entries in per_layer.values()):
        return None
    keys = {k: v for k, v in declared.items() if k not in names}
    keys["model_type"] = built.model_type
    at_depth = functools.partial(_arguments_at_depth, keys, key, tuple(n for n in per_layer if n in declared))
    if file is None:
        knob = f"model.config.{key}"
        return DeclaredDepth(layers=layers, field=knob, value=layers, knob=knob, setting=f"{knob}={{}}",
                             at_depth=at_depth)
    where = str(file).replace("{", "{{").replace("}", "}}")
    return DeclaredDepth(layers=layers, field=field, value=value, knob=f"{key} in {file}",
                         setting=f'"{key}": {{}} in {where}', at_depth=at_depth)


def _arguments_at_depth(keys: dict[str, Any], key: str, per_layer: tuple[str, ...], depth: int) -> dict[str, Any]:
    """``hf_causal_lm``'s arguments for the config ``keys`` with ``depth`` layers."""
    config = {**keys, key: depth, **{name: keys[name][:1] * depth for name in per_layer}}
    return {"config": config, "pretrained_path": None, "config_path": None}


hf_causal_lm.pipeline_layers = pipeline_layers
hf_causal_lm.declared_depth = declared_depth
