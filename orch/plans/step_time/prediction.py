"""A plan's predicted step time as `orch tune` prices it, shared by the tuner's ranking and
`orch check`'s line for the declared plan.

The model's FLOPs, matmul shapes and communication sizes are counted once on the probe
(:func:`orch.plans.step_time.model_cost.measure_model_cost`); the cluster's speeds are what its profile
measured (`orch calibrate`), else what it declares (or the accelerator's defaults), until `orch tune`
measures them on the workers.
"""

from __future__ import annotations

from orch.plans.engines import engine_spec
from orch.plans.memory.estimate import ModelProbe
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import ClusterSpec, OptimSpec
from orch.plans.step_time.cost_model import ModelCost, Speeds, StepTime
from orch.plans.step_time.model_cost import measure_model_cost
from orch.plans.step_time.phases import applied_scales, correction_kind, scaled_step
from orch.plans.step_time.profile import cluster_speeds, runs_range
from orch.plans.step_time.ranges import StepRange, predicted_range

EXACT_PARAMS_LIMIT = 1_000_000_000
"""Models above this many parameters get their FLOPs and activations counted at two shallow depths
and extrapolated (:mod:`orch.plans.model.depth_scaling`), as deep models (``DEPTH_SCALED_FROM`` layers or
more) always are, and the tuner measures their activations at one micro-batch size and scales
them (:class:`orch.plans.search.space.BatchScaledProbe`); smaller ones are counted in full, in ms."""


def plan_step(plan: ResolvedPlan, model: ModelCost, speeds: Speeds, probe: ModelProbe, *, devices_per_node: int,
              optim: OptimSpec) -> StepTime:
    """The predicted step of ``plan`` under its engine, which may read more of the model off the probe,
    with the speeds' phase corrections from finished runs that apply to it, if any (:func:`plan_corrections`).
    A plan that splits the output head over its tensor-parallel ranks is priced from the counts with
    the head split (``ModelCost.split_head``, ``ModelProbe.split_head``)."""
    split = probe.for_plan(plan)
    if split is not probe and model.split_head is not None:
        model, probe = model.split_head, split
    step = engine_spec(plan.engine).step_time(plan, model, speeds, devices_per_node=devices_per_node, optim=optim,
                                              probe=probe)
    if applied := plan_corrections(plan, speeds):
        step = scaled_step(step, applied)
    return step


def plan_corrections(plan: ResolvedPlan, speeds: Speeds) -> dict[str, float]:
    """The phase corrections from finished runs ``plan``'s prediction at ``speeds`` includes, by phase
    group: those of runs of its kind where there are any, else of every run (none without runs)."""
    if not speeds.phase_scale:
        return {}
    return applied_scales(dict(speeds.phase_scale), correction_kind(plan), pipelined=plan.pp > 1)


def count_model_cost(probe: ModelProbe, tp_degrees: list[int], param_count: int, *,
                     split_head: bool = True) -> ModelCost:
    """The model's FLOPs, shapes and sizes as the tuner and `orch check` count them: at two shallow
    depths and extrapolated for a model of :data:`EXACT_PARAMS_LIMIT` parameters or more, or one
    the probe holds only shallow copies of; in full otherwise. ``split_head``: count them with the
    output head split as well, for plans that split it (:func:`measure_model_cost`)."""
    depth_scaled = param_count >= EXACT_PARAMS_LIMIT or probe.shallow is not None
    return measure_model_cost(probe, tp_degrees, depth_scaled=depth_scaled, split_head=split_head)


def declared_plan_step(plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe,
                       param_count: int) -> StepTime:
    """The declared plan's predicted step at the cluster's speeds (its profile's measured ones, else
    the declared ones: :func:`orch.plans.step_time.profile.cluster_speeds`), counted as the tuner
    counts it (the model costed once, at the plan's tensor-parallel degree)."""
    model = count_model_cost(probe, [plan.tp], param_count, split_head=probe.for_plan(plan) is not probe)
    speeds, _ = cluster_speeds(cluster, plan.precision)
    return plan_step(plan, model, speeds, probe, devices_per_node=cluster.devices_per_node, optim=optim)


def declared_step_range(step: StepTime, plan: ResolvedPlan, cluster: ClusterSpec) -> StepRange:
    """The P10-P90 range of :func:`declared_plan_step`'s prediction: the cost model's measured error
    at the kind of speeds it was priced at (the profile's measured ones, or declared), on the plan's
    accelerator (:mod:`orch.plans.step_time.ranges`)."""
    speeds, _ = cluster_speeds(cluster, plan.precision)
    if speeds.phase_scale:
        return runs_range(cluster.measured).scaled(step.total_s)
    return predicted_range(step.total_s, speeds=speeds.source, accelerator=plan.accelerator.value)
