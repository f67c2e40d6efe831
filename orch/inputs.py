"""Every declared value checked before anything starts: ranges, the data and the checkpoint directory.

The pure range rules live in :mod:`orch.plans.validate`; this module adds what needs the file system
(the driver's view of it: it reads ``latest.json`` of the same checkpoint directory to resume,
and the workers of a multi-node cluster share the path). :func:`validated_plan` reports all of
them together with the plan's own problems, in one :class:`PlanError`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from orch.config import RunConfig
from orch.declared import declared_violations
from orch.launchers.storage import StagingDirError, location_violation, private_staging_root
from orch.plans.errors import PlanError, Violation
from orch.plans.model.workload import DataSource
from orch.plans.resolve import ResolvedPlan, resolve_plan
from orch.plans.spec import ClusterSpec, ResumeMode, TrainSpec
from orch.plans.storage.locations import is_remote, local_path, unwritable_reason
from orch.workload import build_data_source
from orch.workloads.local_files import missing_reason


def input_violations(cfg: RunConfig, data: DataSource | None = None) -> list[Violation]:
    """Every declared value that cannot work, whatever the plan: ranges, data, checkpoint directory.

    ``data`` is the run's data source when it is already built (see :mod:`orch.workload`).
    """
    found = declared_violations(cfg)
    if data is None:
        try:
            data = build_data_source(cfg.data)
        except PlanError as error:
            return found + error.violations + checkpoint_dir_violations(cfg.train)
    return found + data_violations(data, 1) + checkpoint_dir_violations(cfg.train)


def data_violations(data: DataSource, samples_per_step: int) -> list[Violation]:
    """The source's own check; a source that fails while checking is reported, not raised."""
    try:
        return list(data.violations(samples_per_step))
    except Exception as error:  # noqa: BLE001 - a user's data source may raise anything
        return [Violation("data", type(data).__name__, f"checking the data failed: {type(error).__name__}: "
                          f"{error}.", "fix the data source's settings")]


def check_inputs(cfg: RunConfig, data: DataSource | None = None) -> None:
    """Raise :class:`PlanError` with :func:`input_violations`, if there are any."""
    found = input_violations(cfg, data)
    if found:
        raise PlanError(found)


def validated_plan(cfg: RunConfig, cluster: ClusterSpec, data: DataSource | None = None) -> ResolvedPlan:
    """The resolved plan, or one :class:`PlanError` with the plan's problems and the inputs' together."""
    found = input_violations(cfg, data) + shared_checkpoint_violations(cfg.train, cluster)
    try:
        plan = resolve_plan(cfg.plan, cluster, cfg.train)
    except PlanError as error:
        found += error.violations
    if found:
        raise PlanError(found)
    return plan


def data_fits_plan(data: DataSource, plan: ResolvedPlan) -> None:
    """Raise :class:`PlanError` unless every data-parallel rank gets a micro-batch of both splits
    (ranks of one replica, across tp and pp, read the same batch)."""
    found = data_violations(data, plan.dp * plan.micro_batch_size)
    if found:
        fix = (f"{found[0].fix}; or lower plan.micro_batch_size({plan.micro_batch_size}) or the data-parallel "
               f"degree dp({plan.dp}): each step draws dp * micro_batch_size = "
               f"{plan.dp * plan.micro_batch_size} samples per split")
        raise PlanError([dataclasses.replace(found[0], fix=fix)])


def shared_checkpoint_violations(train: TrainSpec, cluster: ClusterSpec) -> list[Violation]:
    """A run over several nodes needs a checkpoint directory they all reach: a relative path is
    each node's own working directory, where no node would hold a whole checkpoint."""
    location = train.checkpoint_dir
    uses = train.checkpoint_every > 0 or train.resume == ResumeMode.auto
    if cluster.nodes <= 1 or not uses or is_remote(location) or os.path.isabs(local_path(location)):
        return []
    return [Violation("train.checkpoint_dir", location,
                      f"is relative, and the run spans cluster.nodes={cluster.nodes} nodes: each would write its "
                      "ranks' part of a checkpoint under its own working directory, and none would hold a whole one.",
                      "set it to an absolute path every node mounts (/shared/checkpoints/run) or to a URI "
                      "(s3://bucket/run)")]


def _staging_problem() -> str | None:
    """Why this machine's staging directory for remote checkpoints cannot be used, or None.

    The workers stage a remote checkpoint there before loading it and refuse a directory others
    could read or write (:func:`orch.launchers.storage.private_staging_root`); checked here too, so a
    local run is refused before Ray starts rather than by every worker after it did."""
    try:
        private_staging_root()
    except StagingDirError as error:
        return str(error)
    return None


def checkpoint_dir_violations(train: TrainSpec) -> list[Violation]:
    """A checkpoint directory that will be written must be a directory this user can write, or be
    creatable in one; one that is only read (resume) must not be a file."""
    writes = train.checkpoint_every > 0
    if not writes and train.resume != ResumeMode.auto:
        return []
    if is_remote(train.checkpoint_dir):
        problem = location_violation(train.checkpoint_dir) or _staging_problem()
        if problem is None:
            return []
        why, _, fix = problem.partition(" Fix: ")
        return [Violation("train.checkpoint_dir", train.checkpoint_dir, why, fix)]
    path = Path(local_path(train.checkpoint_dir))
    if path.is_symlink() and (why := missing_reason(path)):
        return [Violation("train.checkpoint_dir", train.checkpoint_dir, why,
                          "point train.checkpoint_dir at a directory, or remove the link (the directory is created "
                          "if missing)")]
    if path.exists() and not path.is_dir():
        return [Violation("train.checkpoint_dir", train.checkpoint_dir, "is a file, not a directory.",
                          "point train.checkpoint_dir at a directory (it is created if missing)")]
    if not writes:
        return []
    if why := unwritable_reason(path):
        return [Violation("train.checkpoint_dir", train.checkpoint_dir, f"checkpoints cannot be written there: {why}.",
                          "point train.checkpoint_dir at a writable directory, or set train.checkpoint_every=0")]
    return []
