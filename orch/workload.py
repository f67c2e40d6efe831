"""The user's workload, resolved once per command from the config into a :class:`orch.plans.model.workload.Workload`.

Every part is declared through Hydra's ``_target_``: the model (any ``torch.nn.Module`` class or
factory), the objective (a class instantiated with its arguments, or a plain function) and the
data source. Errors name the config key (``model.*``, ``objective.*``, ``data.*``) and are
raised before any worker starts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate

from orch.models import (
    PIPELINE_LAYERS_METHOD,
    build_model,
    model_factory,
    pipeline_layers_factory,
    shallowest_config,
    split_model_config,
)
from orch.plans.engines.deepspeed_autotp import specs_from_deepspeed_preset
from orch.plans.errors import PlanError, Violation
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import DataSource, Objective, Workload
from orch.plans.parallel.tp_plan import specs_from_tp_plan

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
"""Files a model's constructor may load weights from (torch and safetensors checkpoints)."""

TP_SPECS_ATTRIBUTE = "tp_layer_specs"
"""A model class may declare how DeepSpeed's AutoTP shards it (``orch.workloads.gpt.GPT`` does)."""


def _target(cfg: dict, section: str) -> Any:
    target = cfg.get("_target_") if isinstance(cfg, dict) else None
    if not target:
        raise PlanError([Violation(f"{section}._target_", None, f"{section} names no _target_.",
                                   f"select a {section} option ({section}=...) or set {section}._target_")])
    try:
        return get_object(target)
    except Exception as error:  # noqa: BLE001 - Hydra wraps import errors of user code in several types
        raise PlanError([Violation(f"{section}._target_", target, f"cannot be imported: {_cause(error)}.",
                                   "check the dotted path, and that its module is importable from the "
                                   "working directory or an installed package")]) from None


def _cause(error: BaseException) -> str:
    while isinstance(error, InstantiationException) and isinstance(error.__cause__, BaseException):
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


def build_objective(cfg: dict) -> Objective:
    """A class target is instantiated with the config's arguments; a function is used as it is
    (with those arguments bound, if any)."""
    target = _target(cfg, "objective")
    arguments = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if not inspect.isclass(target):
        if not callable(target):
            raise PlanError([Violation("objective._target_", cfg["_target_"], "is not callable.",
                                       "name a function (outputs, batch) -> loss, or a class whose instances are")])
        return functools.partial(target, **arguments) if arguments else target
    try:
        return instantiate(cfg, _convert_="all")
    except Exception as error:  # noqa: BLE001 - the user's constructor may raise anything
        raise PlanError([Violation("objective", cfg["_target_"], f"could not be built: {_cause(error)}.",
                                   "fix the objective's arguments")]) from None


_DATASET_SOURCE = "orch.workloads.dataset.DatasetSource"
# What a data source offers the driver and the workers (orch.plans.model.workload.DataSource).
_DATA_SOURCE_METHODS = ("violations", "sizes", "example_batch", "prepare", "datasets", "collate")


def build_data_source(cfg: dict) -> DataSource:
    """The data source the config declares (light: paths and settings; workers open the data).

    Three ways to declare it: a data source by ``_target_`` (a shipped one, or your own
    :class:`orch.plans.model.workload.DataSource`); a map-style torch ``Dataset`` by ``_target_`` (a class
    or a function returning one), as a model or an objective is declared; or a ``dataset:`` key
    with the fields of ``data=dataset`` and no ``_target_``. The last two become
    ``orch.workloads.dataset.DatasetSource``, which builds the dataset in each worker.
    """
    if isinstance(cfg, dict) and "_target_" not in cfg and "dataset" in cfg:
        cfg = {"_target_": _DATASET_SOURCE, **cfg}
    target = _target(cfg, "data")
    if inspect.isclass(target) and issubclass(target, torch.utils.data.Dataset):
        return _dataset_source(cfg, target)
    try:
        built = instantiate(cfg, _convert_="all", _recursive_=False)
    except Exception as error:  # noqa: BLE001 - the user's constructor may raise anything
        raise PlanError([Violation("data", cfg["_target_"], f"could not be built: {_cause(error)}.",
                                   "fix the data source's arguments")]) from None
    if isinstance(built, torch.utils.data.Dataset):  # a function that returns a Dataset
        return _dataset_source(cfg, type(built))
    if missing := [m for m in _DATA_SOURCE_METHODS if not callable(getattr(built, m, None))]:
        raise PlanError([Violation("data._target_", cfg["_target_"],
                                   f"built a {type(built).__name__}, which is neither a torch Dataset nor a data "
                                   f"source (it has no {', '.join(missing)}).",
                                   "name a map-style torch Dataset class or a function returning one, or a data "
                                   "source (orch.plans.model.workload.DataSource)")])
    return built


def _dataset_source(cfg: dict, kind: type) -> DataSource:
    """The user's Dataset, declared by ``data._target_``, as the dataset of a DatasetSource."""
    if issubclass(kind, torch.utils.data.IterableDataset):
        raise PlanError([Violation("data._target_", cfg["_target_"],
                                   f"builds an IterableDataset ({kind.__name__}); the workers shard a map-style "
                                   "Dataset (len and indexing) over the data-parallel replicas and checkpoint "
                                   "their position in it.",
                                   "give it __len__ and __getitem__, or stream files through data=ray")])
    return instantiate({"_target_": _DATASET_SOURCE, "dataset": cfg}, _convert_="all", _recursive_=False)


def declared_tp_specs(model_cfg: dict, constructor_cfg: dict, factory: Callable[[], torch.nn.Module] | None = None,
                      ) -> tuple[list[dict] | None, str | None]:
    """The model's AutoTP layer specs and where they come from: ``model.tp_layer_specs`` in the
    config, else the model class's own :data:`TP_SPECS_ATTRIBUTE`, else the model's own
    tensor-parallel plan (a Hugging Face model's, read off the model built on ``meta``), else
    DeepSpeed's AutoTP preset for its architecture; None when it has none of them."""
    _, declared = split_model_config(model_cfg)
    if declared is not None:
        return declared, "model.tp_layer_specs"
    try:
        target = get_object(constructor_cfg["_target_"])
    except Exception:  # noqa: BLE001 - a factory function, or a target the model check reports
        return None, None
    specs = getattr(target, TP_SPECS_ATTRIBUTE, None)
    if isinstance(specs, list) and specs:
        return specs, f"{target.__name__}.{TP_SPECS_ATTRIBUTE}"
    # The plan names the layers by pattern: a deep model's shallow copy has them all.
    shallowest = shallowest_config(constructor_cfg)
    try:
        with meta_device():
            module = factory() if factory and shallowest is constructor_cfg else build_model(shallowest)
    except Exception:  # noqa: BLE001 - the model check reports a model that cannot be built
        return None, None
    specs = specs_from_tp_plan(module)
    if specs:
        return specs, f"{type(module).__name__}'s own tensor-parallel plan"
    preset = specs_from_deepspeed_preset(module)
    if preset is not None:
        return preset[0], f"DeepSpeed's AutoTP preset '{preset[1]}'"
    return None, None


def weight_file_bytes(constructor_cfg: dict) -> int:
    """Bytes of the weight files named by the model's arguments: a local file, or the weight files
    of a local directory (a ``save_pretrained`` directory holds its shards at the top level)."""
    total = 0
    for value in constructor_cfg.values():
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
        total += sum(f.stat().st_size for f in files if f.is_file() and f.name.endswith(WEIGHT_FILE_SUFFIXES))
    return total


def resolve_workload(model_cfg: dict, objective_cfg: dict, data_cfg: dict) -> Workload:
    """Model factory, objective, data source, tensor-parallel specs and pipeline layers, resolved once."""
    constructor_cfg, _ = split_model_config(model_cfg)
    problems: list[Violation] = []
    built: dict[str, Any] = {}
    for name, build, cfg in (("objective", build_objective, objective_cfg), ("data", build_data_source, data_cfg)):
        try:
            built[name] = build(cfg)
        except PlanError as error:
            problems += error.violations
    if problems:
        raise PlanError(problems)
    factory = model_factory(constructor_cfg)
    specs, source = declared_tp_specs(model_cfg, constructor_cfg, factory)
    try:
        pipeline = pipeline_layers_factory(constructor_cfg)
    except Exception:  # noqa: BLE001 - a factory function or an unimportable target: the model check reports it
        pipeline = None
    refusal = None if pipeline else (
        f"{constructor_cfg.get('_target_', 'the model')} cannot be split into pipeline stages: it has no "
        f"{PIPELINE_LAYERS_METHOD}() classmethod returning its layers (orch.plans.parallel.stage_layers.StageLayer)")
    return Workload(model_factory=factory, objective=built["objective"], data=built["data"],
                    model_config=constructor_cfg, tp_layer_specs=specs, tp_specs_source=source,
                    pipeline_layers=pipeline, pipeline_refusal=refusal,
                    weight_file_bytes=weight_file_bytes(constructor_cfg))

