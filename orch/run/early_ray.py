"""`orch train`'s embedded Ray, started before torch is imported when the declared values size it.

Ray's start is mostly a fixed sequence of its own processes (the GCS, its API server, which must
answer before the raylet starts, the agents) and takes seconds, as importing torch and checking the
model on ``meta`` do. Started first, Ray comes up beside them instead of after the imports. The
values it needs are the plan's world size and accelerator, which the declared plan and cluster give
without building anything, and the CPUs the data's own tasks need, known beforehand only for the
shipped sources that run none (:data:`orch.workloads.schemas.SELF_CONTAINED_SOURCES`). Any other run,
one joining a cluster by address, or one whose declared values or plan arithmetic are wrong, starts
Ray as before, after its inputs are checked: those are refused before any Ray starts. A refusal
found later (a data path, the model, the tracking store) shows nothing of the Ray started early,
which is shut down.

Torch-free, like everything it imports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from orch.config import RunConfig
from orch.declared import declared_violations
from orch.launchers.ray_session import RaySessionHandle, ray_session_in_background
from orch.launchers.worker_group import job_env
from orch.plans.errors import PlanError
from orch.plans.resolve import ResolvedPlan, resolve_plan
from orch.plans.storage.locations import is_remote
from orch.workloads.schemas import SELF_CONTAINED_SOURCES


@contextlib.contextmanager
def early_ray(cfg: RunConfig) -> Iterator[RaySessionHandle | None]:
    """Yield the handle of an embedded Ray started now (see
    :func:`orch.launchers.ray_session.ray_session_in_background`), or None when this run starts its Ray
    later; the Ray is shut down when the block ends."""
    data_target = cfg.data.get("_target_") if isinstance(cfg.data, dict) else None
    if cfg.cluster.address is not None or data_target not in SELF_CONTAINED_SOURCES or declared_violations(cfg):
        yield None
        return
    try:
        plan = resolve_plan(cfg.plan, cfg.cluster, cfg.train)
    except PlanError:
        yield None  # reported with every other problem by the run's own checks
        return
    with run_ray_session(cfg, plan) as ready:
        yield ready


def run_ray_session(cfg: RunConfig, plan: ResolvedPlan, *, data_cpus: float = 0.0):
    """The run's Ray session, held in the background (:func:`orch.launchers.ray_session.ray_session_in_background`):
    ``cluster.address``'s, or an embedded Ray sized for the plan's workers and ``data_cpus`` more,
    whose processes start with the workers' environment."""
    return ray_session_in_background(cfg.cluster.address, worker_cpus=plan.world_size * cfg.cluster.cpus_per_worker,
                                     data_cpus=data_cpus, object_store_gib=cfg.cluster.object_store_memory_gib,
                                     connect_timeout_s=cfg.cluster.connect_timeout_s,
                                     worker_env=job_env(plan.accelerator, cfg.train),
                                     object_store=uses_object_store(cfg))


def uses_object_store(cfg: RunConfig) -> bool:
    """Whether the run's checkpoints or data lie in an object store (s3://, gs://, ...): its
    workers then need the store's credentials (:func:`orch.launchers.passthrough.withheld_from_workers`)."""
    data = cfg.data if isinstance(cfg.data, dict) else {}
    locations = [cfg.train.checkpoint_dir]
    for key in ("paths", "val_paths", "files"):
        value = data.get(key)
        locations += [value] if isinstance(value, str) else list(value or [])
    return any(is_remote(str(location)) for location in locations if location)
