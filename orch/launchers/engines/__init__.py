"""Training engines behind one seam (:mod:`orch.launchers.engines.base`), chosen by ``plan.engine``.

Each engine's module is imported only when a run uses it, so a DeepSpeed run never imports
FSDP2's code and the reverse. An engine package holds its runtime class and the modules the
driver's process asks (:data:`DRIVER_PARTS`, found by :func:`engine_module`).
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


DRIVER_PARTS = ("driver", "export")
"""The modules every engine package holds beside its runtime class, for the driver's process:

- ``driver``: ``engine_config(plan, optim, param_count=, tp_layer_specs=)`` (the job's engine
  config, or None) and ``resume_job(job, published, checkpoint_dir, out)`` (the job pointed at a
  checkpoint, converted for the new layout if the engine needs that);
- ``export``: ``export_refusal(params)`` and ``consolidated_weights(folder, params)``, what
  `orch export` asks of a run's engine.
"""


def engine_module(name: str, part: str) -> ModuleType:
    """The ``part`` module (one of :data:`DRIVER_PARTS`) of the engine ``name``."""
    import importlib

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: known are {', '.join(sorted(ENGINES))}")
    if part not in DRIVER_PARTS:
        raise ValueError(f"unknown engine part {part!r}: known are {', '.join(DRIVER_PARTS)}")
    return importlib.import_module(ENGINES[name].partition(":")[0] + "." + part)


__all__ = ["DRIVER_PARTS", "ENGINES", "BuiltModel", "Engine", "engine_for", "engine_module"]
