"""Facts about a model read without allocating it: built and run on the ``meta`` device."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from orch.plans.errors import PlanError, Violation
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS, DeclaredDepth, ShallowModels
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import (
    PROBE_SAMPLES,
    MetaBranches,
    ModelInputs,
    call_model,
    output_tensor,
    selective_problem,
    supports_activation_checkpointing,
)
from orch.plans.spec import ClusterSpec, Offload, Precision

GIB = 1024**3

MAX_MODULES = 1_000_000
"""More ``torch.nn.Module`` objects than any model built for training has (GPT-3 175B has about a
thousand); each costs kilobytes of Python objects on any device, ``meta`` included, so a model of
millions of layers exhausts a host's memory before a parameter is counted."""


@dataclass(frozen=True)
class ModelFacts:
    param_count: int
    """Distinct parameters (tied ones counted once)."""
    trainable_count: int
    output_size: int
    """Size of the last dimension of the model's output (vocabulary, classes, ...)."""
    supports_activation_checkpointing: bool
    selective_problem: str | None = None
    """Why the model cannot recompute selectively (:func:`orch.plans.model.workload.selective_problem`)."""
    modules: int = 0
    """``torch.nn.Module`` objects in the model: each costs a Python object and its dicts, on any
    device, when the model is built."""


def inspect_model(factory: Callable[[], torch.nn.Module], inputs: ModelInputs,
                  arguments: Mapping[str, object] | None = None) -> ModelFacts:
    """Build the model on ``meta`` and run one forward pass to check its contract.

    The contract: run on one sample of the data source (:func:`orch.plans.model.workload.call_model`), its
    output goes through the objective to a scalar loss. Nothing is allocated, so a
    model far larger than this machine is inspected in milliseconds. The model is user code: an
    exception of its constructor or forward becomes a :class:`PlanError` naming the argument its
    message names (``arguments`` is the model's config: ``_target_`` and constructor arguments).
    """
    arguments = arguments or {}
    with _model_code_errors(arguments, "refused its arguments"), meta_device():
        module = factory()
    return _facts(module, inputs, arguments)


def inspect_shallow(factory_at_depth: Callable[[int], torch.nn.Module], depth: int, inputs: ModelInputs,
                    arguments: Mapping[str, object] | None = None) -> tuple[ModelFacts, ShallowModels]:
    """:func:`inspect_model` of a model of ``depth`` layers, from copies built at two shallow
    depths (:class:`orch.plans.model.depth_scaling.ShallowModels`): the full-depth model is never built.

    ``factory_at_depth(d)`` builds the model with ``d`` layers. The parameter counts are carried
    to ``depth`` along their line, exact when the layers are identical.
    """
    arguments = arguments or {}
    with _model_code_errors(arguments, "refused its arguments"):
        shallow = ShallowModels.build(factory_at_depth, depth)
    return shallow.at_depth(lambda module: _facts(module, inputs, arguments), keep=("output_size",)), shallow


@contextlib.contextmanager
def _model_code_errors(arguments: Mapping[str, object], what: str) -> Iterator[None]:
    """Any failure of the model's code is reported as a config problem, before anything starts."""
    try:
        yield
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError([model_refusal(exc, arguments, what)]) from exc


def _facts(module: torch.nn.Module, inputs: ModelInputs, arguments: Mapping[str, object]) -> ModelFacts:
    batch = inputs.example_batch(PROBE_SAMPLES)
    what = f"failed in forward({_shapes(batch)}) or its objective"
    with _model_code_errors(arguments, what), torch.device("meta"), MetaBranches():
        outputs = call_model(module, batch)
        output = output_tensor(outputs)
        loss = inputs.objective(outputs, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PlanError([Violation("objective", shape,
                                   f"the objective must return a scalar loss for forward({_shapes(batch)}).",
                                   "return one loss value (e.g. a mean over the batch) from the objective")])
    params = {id(p): p for p in module.parameters()}.values()
    return ModelFacts(
        param_count=sum(p.numel() for p in params),
        trainable_count=sum(p.numel() for p in params if p.requires_grad),
        output_size=int(output.shape[-1]) if output.dim() else 1,
        supports_activation_checkpointing=supports_activation_checkpointing(module),
        selective_problem=selective_problem(module),
        modules=_module_count(module),
    )


def _shapes(batch: object) -> str:
    """A batch's structure with its tensors' shapes: ``[1, 128]``, ``(x[1, 3, 32, 32], y[1])``."""
    if isinstance(batch, torch.Tensor):
        return f"[{', '.join(map(str, batch.shape))}]"
    if isinstance(batch, Mapping):
        return ", ".join(f"{k}={_shapes(v)}" for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return _shapes(batch[0]) if batch else "()"
    return type(batch).__name__


# How much of a model's exception message a violation quotes.
_QUOTED_CHARS = 400


def model_refusal(error: Exception, arguments: Mapping[str, object], what: str) -> Violation:
    """A model's exception as a violation of the argument it names (``model.n_head`` or ``'n_head'``
    in its message), else of the model's ``_target_``."""
    target = str(arguments.get("_target_", "the model"))
    text = " ".join(str(error).split())[:_QUOTED_CHARS] or "(no message)"
    named = _named_argument(text, arguments)
    message = f"{target} {what}: {type(error).__name__}: {text}"
    if named is None:
        return Violation("model._target_", target, message,
                         "fix the model's arguments (model.<name>=...) or the model's code")
    return Violation(f"model.{named}", arguments[named], message, f"change model.{named}")


def _named_argument(text: str, arguments: Mapping[str, object]) -> str | None:
    """The constructor argument ``text`` mentions first, as ``model.<name>`` or ``'<name>'``."""
    found = []
    for name in arguments:
        if name == "_target_":
            continue
        match = re.search(rf"model\.{re.escape(name)}\b|'{re.escape(name)}'", text)
        if match:
            found.append((match.start(), name))
    return min(found)[1] if found else None


def refuse_unbuildable(facts: ModelFacts, shallow: ShallowModels, declared: DeclaredDepth, cluster: ClusterSpec,
                       precision: Precision, offload_param: Offload) -> None:
    """Refuse a model no plan could build on ``cluster``, from the arithmetic of its shallow copies.

    Two bounds, both independent of the plan's layout: the module objects any rank must create
    (:data:`MAX_MODULES`), and the parameters alone in the training precision against the memory
    of every device and host of the cluster together, what ZeRO-3 with parameter offload would
    spread them over (parameters offloaded to NVMe are on a disk the cluster does not declare, so
    that bound is skipped for them). ``facts`` are the shallow copies' counts carried to
    ``shallow.depth`` (:func:`inspect_shallow`); ``declared`` says where the config sets it.
    """
    depth, step = shallow.depth, SHALLOW_DEPTHS[1] - SHALLOW_DEPTHS[0]
    problems = []
    if facts.modules > MAX_MODULES:
        per_layer = (_module_count(shallow.deeper) - _module_count(shallow.shallow)) // step
        problems.append(Violation(
            declared.field, declared.value,
            f"{depth:,} layers of {per_layer:,} modules each make {facts.modules:,} torch modules, more than "
            f"{MAX_MODULES:,}: building them (even on the meta device) would exhaust a host's memory.",
            f"use fewer layers ({declared.knob})"))
    param_bytes = facts.param_count * precision.element_bytes
    capacity = _cluster_capacity(cluster)
    if offload_param != Offload.nvme and param_bytes > capacity:
        per_layer = (_param_count(shallow.deeper) - _param_count(shallow.shallow)) // step
        outside = facts.param_count - depth * per_layer
        fitting = max((capacity // precision.element_bytes - outside) // max(per_layer, 1), 0)
        problems.append(Violation(
            declared.field, declared.value,
            f"{depth:,} layers of {per_layer:,} parameters each make {facts.param_count:,} parameters: "
            f"{param_bytes / GIB:,.1f} GiB in {precision.value} for the parameters alone, more than the "
            f"{_capacity_arithmetic(cluster)}, even with every state sharded and offloaded.",
            f"use at most {fitting:,} layers ({declared.setting.format(fitting)}), or more or larger nodes "
            "(cluster.nodes, cluster.device_memory_gib, cluster.host_memory_gib)"))
    if problems:
        raise PlanError(problems)


def refuse_oversized(facts: ModelFacts, arguments: Mapping[str, object], cluster: ClusterSpec, precision: Precision,
                     offload_param: Offload) -> None:
    """Refuse a model whose parameters alone, in the training precision, exceed the memory of every
    device and host of the cluster together: no plan could hold it (the bound of
    :func:`refuse_unbuildable`, for a model inspected whole)."""
    param_bytes = facts.param_count * precision.element_bytes
    capacity = _cluster_capacity(cluster)
    if offload_param == Offload.nvme or param_bytes <= capacity:
        return
    target = str(arguments.get("_target_", "the model"))
    raise PlanError([Violation(
        "model._target_", target,
        f"{target} has {facts.param_count:,} parameters with these arguments: {param_bytes / GIB:,.1f} GiB in "
        f"{precision.value} for the parameters alone, more than the {_capacity_arithmetic(cluster)}, even with "
        "every state sharded and offloaded.",
        "make the model smaller (its size arguments, model.<name>=...), or use more or larger nodes "
        "(cluster.nodes, cluster.device_memory_gib, cluster.host_memory_gib)")])


def _cluster_capacity(cluster: ClusterSpec) -> int:
    """Bytes of every device and host of the cluster together."""
    return int(cluster.nodes * (cluster.devices_per_node * cluster.device_memory_gib + cluster.host_memory_gib) * GIB)


def _capacity_arithmetic(cluster: ClusterSpec) -> str:
    return (f"{_cluster_capacity(cluster) / GIB:,.1f} GiB of the whole cluster ({cluster.nodes} node(s) x "
            f"({cluster.devices_per_node} x {cluster.device_memory_gib:g} GiB devices + "
            f"{cluster.host_memory_gib:g} GiB host memory))")


def _module_count(module: torch.nn.Module) -> int:
    return sum(1 for _ in module.modules())


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
