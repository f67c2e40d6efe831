"""What `orch train`'s driver asks of the FSDP2 engine before its workers start: no config of its
own (it reads the job's ``optim``), and a resume from any checkpoint it wrote as it is
(``torch.distributed.checkpoint`` reshards as it loads, at any dp and tp)."""

from __future__ import annotations

import dataclasses
import os

from orch.launchers.checkpoint import Published
from orch.launchers.job import TrainJob
from orch.plans.optim_settings import OptimSettings
from orch.plans.resolve import ResolvedPlan


def engine_config(plan: ResolvedPlan, optim: OptimSettings, *, param_count: int, tp_layer_specs) -> None:
    """None: FSDP2 reads the job's ``optim`` and ``plan`` only."""
    return None


def resume_job(job: TrainJob, published: Published, checkpoint_dir: str | os.PathLike, out) -> TrainJob:
    """``job`` pointed at ``published``, whatever dp and tp wrote it."""
    return dataclasses.replace(job, resume_tag=published.tag)
