"""Training engines behind one seam (:mod:`orch.launchers.engines.base`), chosen by ``plan.engine``.

Each engine's module is imported only when a run uses it, so a DeepSpeed run never imports
FSDP2's code and the reverse. An engine package holds its runtime class and an ``export`` module
for `orch export` (:func:`engine_export`).
"""

from __future__ import annotations

from types import ModuleType

from orch.launchers.engines.base import BuiltModel, Engine

ENGINES = {"deepspeed": "orch.launchers.engines.deepspeed:DeepSpeedEngine",
           "fsdp2": "orch.launchers.engines.fsdp2:FSDP2Engine"}


def engine_for(name: str) -> Engine:
    """A new engine of the kind ``name`` (a ``plan.engine`` value)."""
    import importlib

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: known are {', '.join(sorted(ENGINES))}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def engine_export(name: str) -> ModuleType:
    """The ``export`` module of the engine ``name``: ``export_refusal(params)`` and
    ``consolidated_weights(folder, params)``, what `orch export` asks of a run's engine."""
    import importlib

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: known are {', '.join(sorted(ENGINES))}")
    return importlib.import_module(ENGINES[name].partition(":")[0] + ".export")


__all__ = ["ENGINES", "BuiltModel", "Engine", "engine_export", "engine_for"]
