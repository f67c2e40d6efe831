"""Model construction from its Hydra config; kept light so `orch check` imports no Ray or MLflow."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate


def build_model(model_cfg: dict) -> torch.nn.Module:
    """Instantiate the model config's ``_target_`` (on meta in the driver, for real in workers).

    The model's own exception is raised as it is, not inside Hydra's InstantiationException,
    whose message repeats the target around it: the planner reports the model's message as the
    reason a config is refused.
    """
    try:
        return instantiate(model_cfg, _convert_="all")
    except InstantiationException as error:
        if isinstance(error.__cause__, Exception):
            raise error.__cause__ from None
        raise


def model_factory(model_cfg: dict) -> Callable[[], torch.nn.Module]:
    """A picklable zero-argument factory, so workers build the model themselves."""
    return functools.partial(build_model, model_cfg)


# A model config key that is not a constructor argument: the model's tensor-parallel layer specs.
TP_SPECS_KEY = "tp_layer_specs"


def split_model_config(model_cfg: dict) -> tuple[dict, list[dict] | None]:
    """The constructor's config, and the model's own tensor-parallel layer specs if it declares
    them (``tp_layer_specs``: a list of ``{patterns, partition_type, ...}`` as DeepSpeed's AutoTP
    takes them); without them the built-in GPT's specs apply."""
    constructor = {k: v for k, v in model_cfg.items() if k != TP_SPECS_KEY}
    return constructor, model_cfg.get(TP_SPECS_KEY)


# The classmethod a model offers to be split into pipeline stages (plan.pp > 1).
PIPELINE_LAYERS_METHOD = "pipeline_layers"


def pipeline_layers_factory(model_cfg: dict) -> Callable[[], list] | None:
    """A picklable factory of the model's pipeline layers, or None if the model cannot be pipelined.

    The model's ``_target_`` class declares them with a ``pipeline_layers(**same arguments)``
    classmethod returning DeepSpeed ``LayerSpec`` / ``TiedLayerSpec`` objects in forward order
    (see workloads/gpt.py): each stage then builds only its own layers.
    """
    target = get_class(model_cfg["_target_"]) if "_target_" in model_cfg else None
    if target is None or not callable(getattr(target, PIPELINE_LAYERS_METHOD, None)):
        return None
    method = f"{model_cfg['_target_']}.{PIPELINE_LAYERS_METHOD}"
    return functools.partial(build_model, {**model_cfg, "_target_": method})
