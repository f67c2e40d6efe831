"""The training engines, asked by name: ``engine_spec(plan.engine)``.

An engine is one spec module (an :class:`orch.plans.engines.base.EngineSpec`: its rules,
settings, memory, step time, tuner axes and description) and one runtime package that the spec
names (the shipped ones under ``orch/launchers/engines/``). The built-in specs load on first use,
so asking for DeepSpeed's never imports FSDP2's modules. Another package adds an engine without
touching orch, by an entry point in the group :data:`ENTRY_POINT_GROUP` naming its spec
(``my_engine = "my_package.spec:SPEC"``), as pytest finds its plugins: every process that
imports orch (the driver, the Ray workers) finds it there. :func:`register_engine` adds one to the
calling process only (planning in that process; a worker would not know it). ``plan.engine=<its
name>`` then selects it everywhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from contextlib import AbstractContextManager

from orch.plans.engines.base import DeviceMemory, EngineSpec

BUILT_IN = {"deepspeed": "orch.plans.engines.deepspeed", "fsdp2": "orch.plans.engines.fsdp2"}
"""The shipped engines' spec modules (each defines ``SPEC``), by ``plan.engine`` value."""

ENTRY_POINT_GROUP = "orch.engines"
"""The entry-point group of installed packages' engine specs (each names an ``EngineSpec`` instance)."""

_registered: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> None:
    """Make ``spec`` the engine ``plan.engine=<spec.name>`` selects (replacing one of that name)."""
    _registered[spec.name] = spec


@functools.cache
def _installed() -> dict[str, importlib.metadata.EntryPoint]:
    """The engines installed packages declare, by name (a built-in name is not theirs to take)."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {point.name: point for point in found if point.name not in BUILT_IN}


def engine_names() -> list[str]:
    """Every engine ``plan.engine`` may name: the built-in ones, then the installed and registered ones."""
    return list(dict.fromkeys([*BUILT_IN, *_installed(), *_registered]))


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine ``name``; ValueError naming the known engines when there is none."""
    if name not in _registered:
        if name in BUILT_IN:
            _registered[name] = importlib.import_module(BUILT_IN[name]).SPEC
        elif name in _installed():
            spec = _installed()[name].load()
            if not isinstance(spec, EngineSpec) or spec.name != name:
                raise ValueError(f"the entry point {name!r} of group {ENTRY_POINT_GROUP} names {spec!r}, which is "
                                 f"not an EngineSpec named {name!r}")
            _registered[name] = spec
        else:
            raise ValueError(f"unknown engine {name!r}: known are {', '.join(engine_names())}")
    return _registered[name]


def whole_parameters(params: list) -> AbstractContextManager | None:
    """A context in which ``params`` are whole and writable, from the engine that partitioned
    them while the model was built (DeepSpeed's ``zero.Init``); None when none did. A model's
    own initialisation asks this, so it knows no engine. Only engines already in use are asked:
    one that partitioned them was loaded to build the model."""
    for name in list(dict.fromkeys([*BUILT_IN, *_registered])):
        if (context := engine_spec(name).whole_parameters(params)) is not None:
            return context
    return None


__all__ = ["BUILT_IN", "ENTRY_POINT_GROUP", "DeviceMemory", "EngineSpec", "engine_names", "engine_spec",
           "register_engine", "whole_parameters"]
