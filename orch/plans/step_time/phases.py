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
               "zero3_hooks": "zero3_hooks_s", "cp": "cp_comm_s", "dp_gather": "dp_gather_s"}
"""Each predicted part (``StepTime.as_dict()["parts_s"]``'s names) and its :class:`StepTime` field."""


PHASES_VERSION = 2
"""Which predicted parts the phase groups below hold, numbered: a run recorded in a cluster profile
keeps the number it was priced under, and corrects predictions only under the same one. 2: ZeRO-1/2's
gather of the updated parameters moved from forward and backward into the optimizer step."""


@dataclass(frozen=True)
class PhaseGroup:
    """Measured phases and the predicted parts they hold."""

    name: str
    phases: tuple[str, ...]
    parts: tuple[str, ...]


OUTSIDE = PhaseGroup("outside the phases", ("other", "data_wait"), ())
"""What no predicted part holds: the step's bookkeeping, and waiting for data (the plan assumes none)."""

STEP_GROUPS = (
    # Kernels, tensor-parallel all-reduces, ZeRO-3's gathers and the gradient reduction: every
    # engine reduces gradients inside its backward.
    PhaseGroup("forward and backward", ("forward", "backward"),
               ("compute", "memory", "bubble", "tp", "dp", "pp", "zero3_hooks", "cp")),
    # The update, the copies an offloaded optimizer makes, and ZeRO-1/2's gather of the updated
    # parameters (DeepSpeed's step() ends with it).
    PhaseGroup("optimizer step", ("optimizer",), ("optimizer", "offload", "dp_gather")),
    OUTSIDE)

PIPELINE_GROUPS = (
    # A pipeline schedule runs forward, backward and the step in one call: compared as a whole.
    PhaseGroup("pipeline schedule", ("pipeline", "forward", "backward", "optimizer"), tuple(PART_FIELDS)),
    OUTSIDE)


def phase_groups(pipelined: bool) -> tuple[PhaseGroup, ...]:
    return PIPELINE_GROUPS if pipelined else STEP_GROUPS


def correction_kind(plan) -> str:
    """The kind of plan a finished run's corrections carry over to: its engine and the engine's own
    settings (``engine=deepspeed zero_stage=2``), and where its optimizer steps. These set the
    work a step does beyond the model's kernels (ZeRO's hooks and bucketed reductions, FSDP2's
    gathers, an optimizer on the host), which the same corrections describe; the degrees, the
    micro-batch and recomputation are priced by the cost model itself."""
    return f"{plan.engine_text()} offload_optimizer={plan.offload_optimizer.value}"


def kind_key(kind: str, group: str) -> str:
    """The key of ``kind``'s own correction of phase group ``group`` in ``Speeds.phase_scale``."""
    return f"{kind}: {group}"


def applied_scales(scales: dict[str, float], kind: str, *, pipelined: bool) -> dict[str, float]:
    """The corrections a plan of ``kind`` takes, by phase group: each group's from the runs of the
    same kind where there are any (``kind_key``), else from every run. A kind of step no run timed
    (a pipelined plan when the runs were not, or the reverse) takes the other kind's groups: a
    pipeline schedule runs the same forward, backward and optimizer work, in one call."""

    def found(groups: tuple[PhaseGroup, ...]) -> dict[str, float]:
        out = {}
        for group in groups:
            scale = scales.get(kind_key(kind, group.name), scales.get(group.name))
            if scale is not None:
                out[group.name] = scale
        return out

    return found(phase_groups(pipelined)) or found(phase_groups(not pipelined))


def scaled_step(step: StepTime, applied: dict[str, float]) -> StepTime:
    """``step`` with each phase group's parts times its scale in ``applied`` (:func:`applied_scales`;
    groups without one as they are), and the rates that follow from its total."""
    changes = {}
    for group in (*STEP_GROUPS, *PIPELINE_GROUPS):
        scale = applied.get(group.name)
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
