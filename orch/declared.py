"""The declared values checked against their ranges, before anything is built or imported.

Torch-free, like everything it imports: `orch train` runs it before it starts an embedded Ray
early (:mod:`orch.run.early_ray`), while torch is still being imported.
"""

from __future__ import annotations

import dataclasses
import types

from orch.config import RunConfig
from orch.plans.elastic import elastic_violations
from orch.plans.errors import PlanError, Violation
from orch.plans.resolve import resolve_plan
from orch.plans.validate import field_violations


def declared_violations(cfg: RunConfig) -> list[Violation]:
    """The declared values outside their ranges (:mod:`orch.plans.validate`); nothing is opened."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                if f.name not in ("model", "data", "objective")}
    if isinstance(cfg.data, dict):
        sections["data"] = types.SimpleNamespace(**{k: v for k, v in cfg.data.items() if not k.startswith("_")})
    return field_violations(sections) + elastic_violations(cfg.train, cfg.plan)


def declared_and_plan_violations(cfg: RunConfig) -> list[Violation]:
    """:func:`declared_violations` and the plan arithmetic's (:func:`orch.plans.resolve.resolve_plan`):
    every problem found without building anything, for a refusal made before the imports."""
    found = declared_violations(cfg)
    try:
        resolve_plan(cfg.plan, cfg.cluster, cfg.train)
    except PlanError as error:
        found += error.violations
    return found
