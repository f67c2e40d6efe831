"""The phases a training step is timed in, and which predicted parts each one holds.

A worker times its step by the phases its engine names (``orch/launchers/step_phases.py``):
forward, backward and the optimizer step, or one pipeline schedule. Timers cannot split a phase
into the cost model's parts (the kernels of a backward from the gradient reduction inside it), so
predictions and measurements meet phase by phase: `orch report` compares them so, and a cluster
profile's corrections from finished runs (`orch calibrate --from-run`) scale the parts so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orch.plans.step_time.cost_model import StepTime

PART_FIELDS = {"compute": "compute_s", "memory": "memory_s", "bubble": "bubble_s", "tp": "tp_comm_s",
               "dp": "dp_comm_s", "pp": "pp_comm_s", "offload": "offload_s", "optimizer": "optimizer_s",
               "zero3_hooks": "zero3_hooks_s"}
"""Each predicted part (``StepTime.as_dict()["parts_s"]``'s names) and its :class:`StepTime` field."""


@dataclass(frozen=True)
class PhaseGroup:
    """Measured phases and the predicted parts they hold."""

    name: str
    phases: tuple[str, ...]
    parts: tuple[str, ...]


OUTSIDE = PhaseGroup("outside the phases", ("other",), ())

STEP_GROUPS = (
    # Kernels, tensor-parallel all-reduces, ZeRO-3's gathers and the gradient reduction: every
    # engine reduces gradients inside its backward.
    PhaseGroup("forward and backward", ("forward", "backward"),
               ("compute", "memory", "bubble", "tp", "dp", "pp", "zero3_hooks")),
    # The update, and the copies an offloaded optimizer makes.
    PhaseGroup("optimizer step", ("optimizer",), ("optimizer", "offload")),
    OUTSIDE)

PIPELINE_GROUPS = (
    # A pipeline schedule runs forward, backward and the step in one call: compared as a whole.
    PhaseGroup("pipeline schedule", ("pipeline", "forward", "backward", "optimizer"), tuple(PART_FIELDS)),
    OUTSIDE)


def phase_groups(pipelined: bool) -> tuple[PhaseGroup, ...]:
    return PIPELINE_GROUPS if pipelined else STEP_GROUPS


def scaled_step(step: StepTime, scales: dict[str, float], *, pipelined: bool) -> StepTime:
    """``step`` with each phase group's parts times its scale (groups without one as they are),
    and the rates that follow from its total. A kind of step no run timed (a pipelined plan when
    the runs were not, or the reverse) takes the other kind's scales for the same parts: a pipeline
    schedule runs the same forward, backward and optimizer work, in one call."""
    groups = phase_groups(pipelined)
    if not any(group.name in scales for group in groups):
        groups = phase_groups(not pipelined)
    changes = {}
    for group in groups:
        scale = scales.get(group.name)
        if scale is None:
            continue
        for part in group.parts:
            field = PART_FIELDS[part]
            changes[field] = getattr(step, field) * scale
    if not changes:
        return step
    scaled = dataclasses.replace(step, **changes)
    speedup = step.total_s / scaled.total_s if scaled.total_s > 0 else 1.0
    return dataclasses.replace(scaled, tokens_per_s=step.tokens_per_s * speedup,
                               tflops_per_device=step.tflops_per_device * speedup,
                               model_tflops_per_device=step.model_tflops_per_device * speedup)
