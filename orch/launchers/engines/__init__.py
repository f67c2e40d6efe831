"""Training engines behind one seam (:mod:`orch.launchers.engines.base`), chosen by ``plan.engine``.

The engine's spec (:func:`orch.plans.engines.engine_spec`) names its runtime class; its module is
imported only when a run uses it, so a DeepSpeed run never imports FSDP2's code and the reverse.
An engine package holds its runtime class and the modules the driver's process asks
(:data:`DRIVER_PARTS`, found by :func:`engine_module`).
"""

from __future__ import annotations

from types import ModuleType

from orch.launchers.engines.base import BuiltModel, Engine
from orch.plans.engines import engine_spec


def _runtime(name: str) -> tuple[str, str]:
    """(module, class) of the runtime engine ``name``'s spec names; ValueError for an unknown name."""
    module, _, cls = engine_spec(name).runtime.partition(":")
    return module, cls


def engine_for(name: str) -> Engine:
    """A new engine of the kind ``name`` (a ``plan.engine`` value)."""
    import importlib

    module, cls = _runtime(name)
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

    module, _ = _runtime(name)
    if part not in DRIVER_PARTS:
        raise ValueError(f"unknown engine part {part!r}: known are {', '.join(DRIVER_PARTS)}")
    return importlib.import_module(f"{module}.{part}")


__all__ = ["DRIVER_PARTS", "BuiltModel", "Engine", "engine_for", "engine_module"]
