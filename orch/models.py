"""Model construction from its Hydra config; kept light so `orch check` imports no Ray or MLflow."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate

from orch.plans.errors import PlanError
from orch.plans.model.depth_scaling import DEPTH_SCALED_FROM, SHALLOW_DEPTHS, DeclaredDepth, ShallowModels
from orch.plans.model.model_facts import (
    ModelFacts,
    inspect_model,
    inspect_shallow,
    refuse_oversized,
    refuse_unbuildable,
)
from orch.plans.model.workload import ModelInputs
from orch.plans.spec import ClusterSpec, Offload, Precision


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


class ModelFactory:
    """The model's zero-argument factory: picklable, so workers build the model themselves, and
    built on ``meta`` once per command.

    The planner needs the model on ``meta`` several times (its contract, the memory probe, the
    activations, the FLOP count, the checkpoint signature, the tensor-parallel plan). Its
    constructor runs once per default dtype; each caller gets a deep copy, which is cheap on
    ``meta`` and lets it change or run its copy (cast it, shard it, run a backward pass) without
    touching the others'. A model that cannot be deep-copied is built again each time. Real
    builds (workers, export) are never cached, and the cache is not pickled.
    """

    def __init__(self, model_cfg: dict):
        self.model_cfg = model_cfg
        self._on_meta: dict[torch.dtype, torch.nn.Module] = {}
        self._copyable = True

    def __call__(self) -> torch.nn.Module:
        if torch.get_default_device().type != "meta" or not self._copyable:
            return build_model(self.model_cfg)
        dtype = torch.get_default_dtype()
        if dtype not in self._on_meta:
            self._on_meta[dtype] = build_model(self.model_cfg)
        try:
            return copy.deepcopy(self._on_meta[dtype])
        except Exception:  # noqa: BLE001 - a user's module may hold what deepcopy refuses (locks, handles)
            self._copyable = False
            return self._on_meta.pop(dtype)

    def __getstate__(self) -> dict:
        return {"model_cfg": self.model_cfg}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_cfg"])


def model_factory(model_cfg: dict) -> ModelFactory:
    """The model's :class:`ModelFactory`."""
    return ModelFactory(model_cfg)


# A model config key that is not a constructor argument: the model's tensor-parallel layer specs.
TP_SPECS_KEY = "tp_layer_specs"


def split_model_config(model_cfg: dict) -> tuple[dict, list[dict] | None]:
    """The constructor's config, and the model's own tensor-parallel layer specs if it declares
    them (``tp_layer_specs``: a list of ``{patterns, partition_type, ...}`` as DeepSpeed's AutoTP
    takes them); without them the built-in GPT's specs apply."""
    constructor = {k: v for k, v in model_cfg.items() if k != TP_SPECS_KEY}
    return constructor, model_cfg.get(TP_SPECS_KEY)


# The classmethod a model offers to be split into pipeline stages (plan.pp > 1): its layers as
# orch.plans.parallel.stage_layers.StageLayer objects, which each engine turns into its own.
PIPELINE_LAYERS_METHOD = "pipeline_layers"


def pipeline_layers_factory(model_cfg: dict) -> Callable[..., list] | None:
    """A picklable factory of the model's pipeline layers, or None if the model cannot be pipelined.

    The model's ``_target_`` class declares them with a ``pipeline_layers(**same arguments)``
    classmethod returning :class:`~orch.plans.parallel.stage_layers.StageLayer` objects in forward order
    (see orch/workloads/gpt.py): each stage then builds only its own layers. DeepSpeed
    ``LayerSpec`` / ``TiedLayerSpec`` objects are still accepted, for models written against them.
    """
    target = get_object(model_cfg["_target_"]) if "_target_" in model_cfg else None
    if target is None or not callable(getattr(target, PIPELINE_LAYERS_METHOD, None)):
        return None
    return functools.partial(build_pipeline_layers, model_cfg)


def build_pipeline_layers(model_cfg: dict, depth: int | None = None) -> list:
    """The model's pipeline layers; with ``depth``, of the model with that many layers instead
    (what the planner measures a deep model's layers from, see :func:`declared_depth`)."""
    cfg = model_cfg if depth is None else config_at_depth(model_cfg, depth)
    return build_model({**cfg, "_target_": f"{model_cfg['_target_']}.{PIPELINE_LAYERS_METHOD}"})


# The constructor argument that sets a model's depth (the built-in GPT's, and Hugging Face GPT-2's).
DEPTH_KEY = "n_layer"

# What a model's ``_target_`` may offer when its depth is not a ``n_layer`` argument:
# ``declared_depth(**arguments) -> orch.plans.model.depth_scaling.DeclaredDepth | None`` (orch/workloads/hf.py's
# reads a Hugging Face config's num_hidden_layers).
DEPTH_METHOD = "declared_depth"


def model_depth(model_cfg: dict) -> DeclaredDepth | None:
    """How deep the model's config makes it, whatever the depth: the target's own
    :data:`DEPTH_METHOD`, else a ``n_layer`` argument; None when neither says.

    Arguments the target's method cannot read give None: building the model reports them.
    """
    try:
        target = get_object(model_cfg["_target_"]) if "_target_" in model_cfg else None
    except Exception:  # noqa: BLE001 - an unimportable target: the model check reports it
        return None
    method = getattr(target, DEPTH_METHOD, None)
    if callable(method):
        try:
            return method(**{k: v for k, v in model_cfg.items() if k != "_target_"})
        except Exception:  # noqa: BLE001 - the model's arguments are checked when it is built
            return None
    layers = model_cfg.get(DEPTH_KEY)
    if not isinstance(layers, int) or isinstance(layers, bool):
        return None
    field = f"model.{DEPTH_KEY}"
    return DeclaredDepth(layers=layers, field=field, value=layers, knob=field, setting=f"{field}={{}}",
                         at_depth=functools.partial(_with_n_layer, model_cfg))


def _with_n_layer(model_cfg: dict, depth: int) -> dict:
    return {**model_cfg, DEPTH_KEY: depth}


def declared_depth(model_cfg: dict) -> DeclaredDepth | None:
    """:func:`model_depth` when the model is deep enough to be inspected from shallow copies."""
    depth = model_depth(model_cfg)
    return depth if depth is not None and depth.layers >= DEPTH_SCALED_FROM else None


def config_at_depth(model_cfg: dict, depth: int) -> dict:
    """The model's config with ``depth`` layers (its ``_target_`` kept)."""
    declared = model_depth(model_cfg)
    if declared is None:
        raise ValueError(f"{model_cfg.get('_target_', 'the model')} declares no depth to change")
    return {"_target_": model_cfg["_target_"], **declared.at_depth(depth)}


def build_at_depth(model_cfg: dict, depth: int) -> torch.nn.Module:
    return build_model(config_at_depth(model_cfg, depth))


def shallowest_config(model_cfg: dict) -> dict:
    """The model's config at the shallowest depth the planner measures when it is deep, else the
    config itself: what reading the model's layers' names (its tensor-parallel plan) needs."""
    return model_cfg if declared_depth(model_cfg) is None else config_at_depth(model_cfg, SHALLOW_DEPTHS[0])


def inspect_declared_model(model_cfg: dict, inputs: ModelInputs, cluster: ClusterSpec, precision: Precision,
                           offload_param: Offload, factory: Callable[[], torch.nn.Module] | None = None,
                           ) -> tuple[ModelFacts, ShallowModels | None]:
    """The model's facts, and its shallow copies when the planner can count from them.

    A deep model (:func:`declared_depth`) is built at two shallow depths only: a model no plan
    could hold on ``cluster`` is refused from their arithmetic before anything of its full
    depth exists (:func:`orch.plans.model.model_facts.refuse_unbuildable`). If its layers turn out not to
    be one stack of identical blocks, the counts would not be exact, and a model that cannot be
    built that shallow has its own minimum depth: either is then inspected in full, as a shallow
    model always is.
    """
    depth = declared_depth(model_cfg)
    shallow = None
    if depth is not None:
        try:
            facts, shallow = inspect_shallow(functools.partial(build_at_depth, model_cfg), depth.layers, inputs,
                                             arguments=model_cfg)
        except PlanError:  # a model with its own minimum depth: inspected at the declared one, as a small model is
            shallow = None
    if shallow is not None:
        refuse_unbuildable(facts, shallow, depth, cluster, precision, offload_param)
        if shallow.exact:
            return facts, shallow
    facts = inspect_model(factory or model_factory(model_cfg), inputs, arguments=model_cfg)
    refuse_oversized(facts, model_cfg, cluster, precision, offload_param)
    return facts, None
