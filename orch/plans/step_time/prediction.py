"""A plan's predicted step time as `orch tune` prices it, shared by the tuner's ranking and
`orch check`'s line for the declared plan.

The model's FLOPs, matmul shapes and communication sizes are counted once on the probe
(:func:`orch.plans.step_time.model_cost.measure_model_cost`); the cluster's speeds are what it declares (or the
accelerator's defaults) until `orch tune` measures them on the workers.
"""

from __future__ import annotations

from orch.plans.engines import engine_spec
from orch.plans.memory.estimate import ModelProbe
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import ClusterSpec, OptimSpec, Precision
from orch.plans.step_time.cost_model import DECLARED_SPEEDS, ModelCost, Speeds, StepTime, speed_defaults
from orch.plans.step_time.model_cost import measure_model_cost
from orch.plans.step_time.ranges import StepRange, predicted_range

EXACT_PARAMS_LIMIT = 1_000_000_000
"""Models above this many parameters get their FLOPs and activations counted at two shallow depths
and extrapolated (:mod:`orch.plans.model.depth_scaling`), as deep models (``DEPTH_SCALED_FROM`` layers or
more) always are, and the tuner measures their activations at one micro-batch size and scales
them (:class:`orch.plans.search.space.BatchScaledProbe`); smaller ones are counted in full, in ms."""


def plan_step(plan: ResolvedPlan, model: ModelCost, speeds: Speeds, probe: ModelProbe, *, devices_per_node: int,
              optim: OptimSpec) -> StepTime:
    """The predicted step of ``plan`` under its engine, which may read more of the model off the probe."""
    return engine_spec(plan.engine).step_time(plan, model, speeds, devices_per_node=devices_per_node, optim=optim,
                                              probe=probe)


def count_model_cost(probe: ModelProbe, tp_degrees: list[int], param_count: int) -> ModelCost:
    """The model's FLOPs, shapes and sizes as the tuner and `orch check` count them: at two shallow
    depths and extrapolated for a model of :data:`EXACT_PARAMS_LIMIT` parameters or more, or one
    the probe holds only shallow copies of; in full otherwise."""
    depth_scaled = param_count >= EXACT_PARAMS_LIMIT or probe.shallow is not None
    return measure_model_cost(probe, tp_degrees, depth_scaled=depth_scaled)


def declared_plan_step(plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe,
                       param_count: int) -> StepTime:
    """The declared plan's predicted step at the cluster's declared speeds, counted as the tuner
    counts it (the model costed once, at the plan's tensor-parallel degree)."""
    model = count_model_cost(probe, [plan.tp], param_count)
    return plan_step(plan, model, Speeds.declared(cluster, plan.precision), probe,
                     devices_per_node=cluster.devices_per_node, optim=optim)


def declared_step_range(step: StepTime, plan: ResolvedPlan) -> StepRange:
    """The P10-P90 range of :func:`declared_plan_step`'s prediction: the cost model's measured error
    at declared speeds, on the plan's accelerator (:mod:`orch.plans.step_time.ranges`)."""
    return predicted_range(step.total_s, speeds="declared", accelerator=plan.accelerator.value)


def declared_speeds_note(cluster: ClusterSpec, precision: Precision | None = None) -> str:
    """Where the declared speeds come from: the cluster config, or the accelerator's defaults for
    those it leaves unset (at the plan's precision), named with the values used."""
    defaulted = speed_defaults(cluster, precision)
    accelerator = cluster.accelerator.value
    if len(defaulted) == len(DECLARED_SPEEDS[accelerator]):
        return (f"the {accelerator} defaults of orch/plans/step_time/cost_model.py DECLARED_SPEEDS (the cluster "
                "config sets none; set cluster.device_tflops, ... to declare your own)")
    note = "declared in the cluster config (cluster.device_tflops, ...)"
    if defaulted:
        note += f"; unset, so the {accelerator} defaults: " + ", ".join(
            f"cluster.{name}={value:g}" for name, value in defaulted.items())
    return note
