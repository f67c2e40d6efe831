"""A model split into pipeline stages, described without naming a training engine.

A model that can be pipelined (``plan.pp > 1``) lists its layers in forward order as
:class:`StageLayer` objects from a ``pipeline_layers(**model arguments)`` classmethod (see
orch/workloads/gpt.py). Each describes how to build one layer rather than holding it, so a stage
builds only the layers it owns and the planner builds them one at a time on ``meta``. The engine
turns the list into its own pipeline layers (DeepSpeed's in
orch/launchers/engines/deepspeed/building.py); workloads never import an engine for it.

The list ends with the layer that computes the model's output (the logits). The loss on the last
stage is not a layer: it stays the workload's objective, which the engine attaches to that stage.

Only torch and the standard library are imported here: workloads and launchers both read this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True, kw_only=True)
class StageLayer:
    """One layer of a pipelined model, built lazily by the stage that owns it.

    Layers with the same ``tie`` share one weight, kept equal across the stages holding a copy
    (a tied input embedding and output head): the engine builds the module once per stage and
    key, from the first layer with that key, and synchronizes ``tied_weight_attr`` between stages.
    """

    module: Callable[..., nn.Module]
    """The module class, or any callable returning an ``nn.Module`` (DeepSpeed takes classes only)."""
    args: tuple[Any, ...] = ()
    """Positional arguments ``module`` is called with."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments ``module`` is called with."""
    tie: str | None = None
    """Layers with the same key share one module and its ``tied_weight_attr``; None: not shared."""
    tied_weight_attr: str | tuple[str, ...] = "weight"
    """Attribute path(s) of the shared weight on the built module (``"wte.weight"``), as DeepSpeed's."""
    forward_fn: Callable[[nn.Module, Any], Any] | None = None
    """How a tied copy runs, ``forward_fn(module, x)`` (logits from the embedding's weight); None:
    the module's own forward."""
    names: Mapping[str, str] = field(default_factory=dict)
    """Where the layer's state sits in the whole model: a prefix of its own parameter and buffer
    names -> the whole model's (``{"": "blocks.3."}``), the first matching key applying. With
    names, a pipelined checkpoint holds the whole model's state dict (the fsdp2 engine resumes it
    at any pp); empty: the layer is saved as ``pipeline.<index>.``."""

    def __post_init__(self) -> None:
        if not callable(self.module):
            raise TypeError(f"StageLayer.module must be an nn.Module class or a callable returning one, "
                            f"not {self.module!r}")
        if self.tie is None and self.forward_fn is not None:
            # A layer of its own runs its forward; forward_fn exists for a second use of a shared one.
            raise ValueError(f"StageLayer({self.name}) has a forward_fn but no tie: forward_fn is how a "
                             "tied copy runs; set tie to the key of the layer it shares, or drop forward_fn")

    @classmethod
    def of(cls, module: Callable[..., nn.Module], *args: Any, tie: str | None = None,
           tied_weight_attr: str | tuple[str, ...] = "weight",
           forward_fn: Callable[[nn.Module, Any], Any] | None = None, names: Mapping[str, str] | None = None,
           **kwargs: Any) -> StageLayer:
        """``module(*args, **kwargs)`` as a stage layer, written as the call it stands for."""
        return cls(module=module, args=args, kwargs=kwargs, tie=tie, tied_weight_attr=tied_weight_attr,
                   forward_fn=forward_fn, names=dict(names or {}))

    @property
    def tied_weights(self) -> tuple[str, ...]:
        """:attr:`tied_weight_attr` as a tuple of attribute paths."""
        attr = self.tied_weight_attr
        return attr if isinstance(attr, tuple) else (attr,)

    @property
    def name(self) -> str:
        """The module's name, for messages."""
        return getattr(self.module, "__name__", type(self.module).__name__)

    def build(self) -> nn.Module:
        """The layer's module, built on the current default device."""
        return self.module(*self.args, **self.kwargs)


def whole_name(spec: StageLayer, own: str, index: int) -> str:
    """The whole model's name for ``own``, a name inside layer ``index`` (``spec``): the first of
    ``spec.names`` whose key prefixes it, replaced; without names, ``pipeline.<index>.<own>``
    (a checkpoint that then resumes only at the same cut)."""
    for prefix, replacement in spec.names.items():
        if own.startswith(prefix) or own + "." == prefix:
            return (replacement + own[len(prefix):]).rstrip(".")
    return f"pipeline.{index}.{own}".rstrip(".")


def declared(layers: Iterable[StageLayer], attribute: str) -> bool:
    """Whether a layer class of ``layers`` declares ``attribute``: how a model's pipeline layers say
    what an engine may set on them (``sequence_shards``, ``context_positions``), read by the
    planner and the engine alike."""
    return any(hasattr(layer.module, attribute) for layer in layers)
