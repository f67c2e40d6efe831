"""Training engines behind one seam (:mod:`orch.launchers.engines.base`), chosen by ``plan.engine``.

Each engine's module is imported only when a run uses it, so a DeepSpeed run never imports
FSDP2's code and the reverse.
"""

from __future__ import annotations

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


__all__ = ["ENGINES", "BuiltModel", "Engine", "engine_for"]
