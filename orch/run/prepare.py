"""A run made ready for its workers: the plan checked against the cluster, the job the workers run,
the shape of their group, and the job pointed at a checkpoint to resume.

`orch train` prepares its declared run here once; an elastic run (:mod:`orch.run.elastic`) prepares
each plan it re-plans to the same way.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from orch.checking import checked_run
from orch.config import RunConfig
from orch.inputs import data_fits_plan
from orch.launchers.checkpoint import Published
from orch.launchers.engines import engine_module
from orch.launchers.job import TrainJob
from orch.launchers.placement import placement_strategy
from orch.launchers.worker_group import WorkerGroupSpec, job_env
from orch.plans.errors import PlanError, Violation
from orch.plans.memory.estimate import PlanEstimate
from orch.plans.model.model_facts import ModelFacts
from orch.plans.model.workload import Workload
from orch.plans.optim_settings import optim_settings
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, ClusterSpec
from orch.plans.step_time.cost_model import StepTime
from orch.plans.step_time.flops import training_flops_per_sample
from orch.plans.step_time.prediction import declared_plan_step, declared_step_range
from orch.plans.step_time.profile import cluster_speeds, mfu_peak
from orch.run.resume import signature_of


@dataclass(frozen=True, kw_only=True)
class PreparedJob:
    """Everything a run needs before its workers start: the checked plan and what the workers get."""

    estimate: PlanEstimate
    facts: ModelFacts
    workload: Workload
    job: TrainJob
    group_spec: WorkerGroupSpec
    flops_per_sample: int
    predicted_step: StepTime | None = None
    """The plan's step as `orch check` predicts it, at the cluster's declared speeds: the run logs it
    beside what its steps measure (`orch report` compares them)."""
    slowdown_ratio: float | None = None
    """The top of that prediction's P10-P90 range over the prediction, when it is priced at the
    cluster's measured speeds and its range is known: a step slower than this (and the threshold)
    is named (:mod:`orch.tracking.plan_slowdown`); None: not compared."""
    mfu_peak_source: str = ""
    """Where the matmul rate the run's MFU is over comes from (:func:`orch.plans.step_time.profile.mfu_peak`)."""

    @property
    def plan(self) -> ResolvedPlan:
        return self.job.plan


def prepare_job(cfg: RunConfig, model_cfg: dict, cluster: ClusterSpec, *, workload: Workload | None = None,
                plan: ResolvedPlan | None = None) -> PreparedJob:
    """Check the plan, the inputs and the data against ``cluster`` (raising :class:`PlanError`
    with every problem), then build the job the workers run and the worker group's shape.
    ``workload`` and ``plan`` are :func:`orch.checking.resolve_inputs`'s, if it ran."""
    estimate, facts, probe, workload = checked_run(cfg, model_cfg, cluster, workload=workload, plan=plan)
    plan = estimate.plan
    data_fits_plan(workload.data, plan)
    if not estimate.feasible:
        if not cfg.train.force:
            raise PlanError(with_suggestions(estimate))
        print("warning: the planner predicts this plan does not fit; launching anyway because train.force=true",
              file=sys.stderr)
    optim = optim_settings(plan, cfg.optim, cfg.train.steps)
    engine_config = engine_module(plan.engine, "driver").engine_config(
        plan, optim, param_count=facts.param_count, tp_layer_specs=workload.tp_layer_specs)
    peak_tflops, peak_source = mfu_peak(cluster, plan.precision)
    job = TrainJob(plan=plan, optim=optim, engine_config=engine_config, workload=workload, train=cfg.train,
                   mfu_peak_tflops=peak_tflops,
                   env=job_env(plan.accelerator, cfg.train),
                   model_signature=signature_of(workload.model_factory, workload.model_config, cfg.train),
                   system_metrics_interval_s=cfg.tracking.system_metrics_interval_s if cfg.tracking.enabled else 0.0)
    group_spec = WorkerGroupSpec(world_size=plan.world_size, cpus_per_worker=cfg.cluster.cpus_per_worker,
                                 gpus_per_worker=1.0 if plan.accelerator == Accelerator.gpu else 0.0,
                                 env=job.env, wait_s=cfg.cluster.wait_s, tp=plan.tp,
                                 strategy=placement_strategy(cluster.nodes))
    flops = training_flops_per_sample(workload.model_factory, workload, checkpointing=plan.activation_checkpointing,
                                      every_n_layers=plan.recompute_every_n_layers)
    predicted = declared_plan_step(plan, cluster, cfg.optim, probe, facts.param_count)
    return PreparedJob(estimate=estimate, facts=facts, workload=workload, job=job, group_spec=group_spec,
                       flops_per_sample=flops, predicted_step=predicted,
                       slowdown_ratio=slowdown_ratio(predicted, plan, cluster), mfu_peak_source=peak_source)


def slowdown_ratio(predicted: StepTime, plan: ResolvedPlan, cluster: ClusterSpec) -> float | None:
    """:attr:`PreparedJob.slowdown_ratio` of ``predicted``."""
    speeds, _ = cluster_speeds(cluster, plan.precision)
    spread = declared_step_range(predicted, plan, cluster)
    if speeds.source != "measured" or not spread.known or predicted.total_s <= 0:
        return None
    return spread.p90 / predicted.total_s


def resume_from(job: TrainJob, cfg: RunConfig, published: Published, out) -> TrainJob:
    """The job pointed at ``published``: as written, or converted to a universal checkpoint when
    it was written with another layout, as the engine's driver part says (raises PlanError for
    changes nothing can bridge)."""
    saved_engine = (published.layout or {}).get("engine", "deepspeed")
    if saved_engine != job.plan.engine:
        raise PlanError([Violation(
            "plan.engine", job.plan.engine,
            f"the checkpoint to resume (step {published.step}) was written by the {saved_engine} engine, whose "
            "files this engine cannot read.", f"set plan.engine={saved_engine}, or train.resume=never to start fresh")])
    return engine_module(job.plan.engine, "driver").resume_job(job, published, cfg.train.checkpoint_dir, out)


def with_suggestions(estimate: PlanEstimate) -> list[Violation]:
    """The planner's violations, with the fixes it found folded into each one."""
    fixes = "; or ".join(estimate.suggestions) if estimate.suggestions else None
    return [dataclasses.replace(v, fix=f"{fixes or v.fix} (or set train.force=true to launch anyway)")
            for v in estimate.violations]
