"""What `orch train`'s driver asks of the DeepSpeed engine before its workers start: the job's
DeepSpeed config, and a resume from a checkpoint written at another dp degree (converted to a
universal checkpoint once, by DeepSpeed's own converter)."""

from __future__ import annotations

import dataclasses
import os

from orch.launchers.checkpoint import Published
from orch.launchers.engines.deepspeed.config import build_ds_config
from orch.launchers.engines.deepspeed.universal import convert, needs_universal
from orch.launchers.job import TrainJob
from orch.plans.optim_settings import OptimSettings
from orch.plans.resolve import ResolvedPlan


def engine_config(plan: ResolvedPlan, optim: OptimSettings, *, param_count: int, tp_layer_specs) -> dict:
    """DeepSpeed's JSON config for the job (:func:`build_ds_config`)."""
    return build_ds_config(plan, optim, param_count=param_count, tp_layer_specs=tp_layer_specs)


def resume_job(job: TrainJob, published: Published, checkpoint_dir: str | os.PathLike, out) -> TrainJob:
    """``job`` pointed at ``published``: as written, or converted to a universal checkpoint when it
    was written at another dp degree (raises PlanError for changes nothing can bridge)."""
    config = {k: v for k, v in job.engine_config.items() if k != "checkpoint"}
    if not needs_universal(published.layout, job.plan):
        return dataclasses.replace(job, resume_tag=published.tag, engine_config=config)
    print(f"the checkpoint at step {published.step} was written with dp={published.layout['dp']}; converting it "
          f"to a universal checkpoint for dp={job.plan.dp}", file=out, flush=True)
    tag = convert(checkpoint_dir, published.tag, env=job.env)
    return dataclasses.replace(job, resume_tag=tag, engine_config={**config, "checkpoint": {"load_universal": True}})
