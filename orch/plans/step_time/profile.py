"""Which speeds a prediction uses: the cluster profile's measured ones, or the declared ones.

`orch calibrate` measures a cluster once and writes a cluster profile: the cluster's declaration
plus a ``measured`` section (:class:`orch.plans.spec.MeasuredSpeeds`). Every prediction (`orch
check`'s step time, `orch tune`'s ranking, the step `orch train` tracks) then prices the plan at
those speeds instead of the declared or default ones, and says which it used.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from orch.plans.errors import PlanError, Violation
from orch.plans.spec import ClusterSpec, MatmulRate, MeasuredSpeeds, Precision, RunObservation
from orch.plans.step_time.cost_model import COLLECTIVE_SHARES, DECLARED_SPEEDS, Speeds, fp8_speedup, speed_defaults
from orch.plans.step_time.ranges import StepRange, held_out_range

_RATES = ("intra_node_gbps", "inter_node_gbps", "host_link_gbps", "device_memory_gb_per_s", "host_memory_gb_per_s",
          "core_share", "memory_efficiency", "intra_bus_efficiency", "inter_bus_efficiency", "attention_share",
          *COLLECTIVE_SHARES)
"""Speeds the cost model divides by: 0 would fail a prediction as a ZeroDivisionError."""

_NOT_NUMBERS = ("matmul_tflops", "matmul_tiles", "phase_scale", "source")


def speeds_problems(speeds: Speeds) -> list[str]:
    """What makes ``speeds`` unable to price a plan ('' for none): a number that is not finite or
    is negative, or a rate the cost model divides by that is 0 (a file edited by hand, or a
    measurement that went wrong)."""
    problems = []
    for field in dataclasses.fields(speeds):
        value = getattr(speeds, field.name)
        if field.name in _NOT_NUMBERS:
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            problems.append(f"{field.name}={value!r} is not a finite number >= 0")
        elif field.name in _RATES and value == 0:
            problems.append(f"{field.name}=0, a rate the step time is divided by")
    if not speeds.matmul_tflops:
        problems.append("matmul_tflops is empty")
    for phase, scale in speeds.phase_scale:
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            problems.append(f"the runs' correction of {phase!r} is {scale!r}; it needs a finite number > 0")
    for rows, tflops in speeds.matmul_tflops:
        if not all(isinstance(n, (int, float)) and math.isfinite(n) for n in (rows, tflops)) or rows < 0 \
                or tflops <= 0:
            problems.append(f"matmul_tflops has rows={rows!r} tflops={tflops!r}; each needs rows >= 0 and tflops > 0")
    for tile in speeds.matmul_tiles:
        if not all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 for n in tile):
            problems.append(f"matmul_tiles has {tile!r}; each needs finite numbers >= 0")
    return problems


def profile_speeds(measured: MeasuredSpeeds) -> Speeds:
    """The cost model's speeds from a cluster profile's ``measured`` section."""
    rates = sorted((int(rate.rows), float(rate.tflops)) for rate in measured.matmul_tflops)
    return Speeds(matmul_tflops=tuple(rates), intra_node_gbps=measured.intra_node_gbps,
                  inter_node_gbps=measured.inter_node_gbps, intra_latency_s=measured.intra_latency_s,
                  inter_latency_s=measured.inter_latency_s, intra_bus_efficiency=measured.intra_bus_efficiency,
                  inter_bus_efficiency=measured.inter_bus_efficiency, host_link_gbps=measured.host_link_gbps,
                  **{share: getattr(measured, share) for share in COLLECTIVE_SHARES},
                  device_memory_gb_per_s=measured.device_memory_gb_per_s,
                  host_memory_gb_per_s=measured.host_memory_gb_per_s,
                  host_optimizer_params_per_s=measured.host_optimizer_params_per_s,
                  op_overhead_s=measured.op_overhead_s, core_share=measured.core_share,
                  attention_share=measured.attention_share,
                  # Measured matmuls are priced by height, as the calibration timed them.
                  sm_count=0, phase_scale=tuple(sorted(run_corrections(measured).items())), source="measured")


def current_runs(runs: list[RunObservation]) -> list[RunObservation]:
    """The recorded ``runs`` priced under today's phase groups (:data:`orch.plans.step_time.phases.PHASES_VERSION`):
    only they can correct a prediction, phase by phase."""
    from orch.plans.step_time.phases import PHASES_VERSION

    return [run for run in runs if run.phases_version == PHASES_VERSION]


def run_corrections(measured: MeasuredSpeeds) -> dict[str, float]:
    """Each phase group's correction from the profile's finished runs (:func:`corrections_of`)."""
    return corrections_of(current_runs(measured.runs))


def corrections_of(runs: list[RunObservation]) -> dict[str, float]:
    """Each phase group's correction from finished ``runs``: the median of measured over predicted
    among the runs that timed it (a group no run predicted time for has none), and the same among
    the runs of each kind that recorded theirs, under ``kind_key(kind, group)``: a plan takes its
    own kind's where there are any (:func:`orch.plans.step_time.phases.applied_scales`)."""
    from orch.plans.step_time.phases import kind_key

    ratios: dict[str, list[float]] = {}
    for run in runs:
        for observed in run.phases:
            if observed.predicted_s > 0 and observed.measured_s > 0:
                ratio = observed.measured_s / observed.predicted_s
                ratios.setdefault(observed.phase, []).append(ratio)
                if run.kind:
                    ratios.setdefault(kind_key(run.kind, observed.phase), []).append(ratio)
    return {phase: statistics.median(values) for phase, values in ratios.items()}


def held_out_predictions(runs: list[RunObservation]) -> list[tuple[RunObservation, float, float]]:
    """(run, its predicted seconds corrected by the *other* runs only, its measured seconds), over
    the phases it timed and the model priced, for each run that has such phases: how far the
    corrections carry to a run they did not see, as a plan of its kind would take them."""
    from orch.plans.step_time.phases import applied_scales

    out = []
    runs = current_runs(runs)
    for index, run in enumerate(runs):
        phases = [phase for phase in run.phases if phase.predicted_s > 0 and phase.measured_s > 0]
        if not phases:
            continue
        scales = applied_scales(corrections_of(runs[:index] + runs[index + 1:]), run.kind,
                                pipelined=any(phase.phase == "pipeline schedule" for phase in phases))
        predicted = sum(phase.predicted_s * scales.get(phase.phase, 1.0) for phase in phases)
        out.append((run, predicted, sum(phase.measured_s for phase in phases)))
    return out


def held_out_ratios(measured: MeasuredSpeeds) -> list[float]:
    """Each recorded run's measured / predicted step time, its prediction corrected by the other
    runs only (:func:`held_out_predictions`). A kind with one run falls back to the median over the
    others, so the ratios overstate the error of a plan whose kind has a run."""
    return [measured_s / predicted for _, predicted, measured_s in held_out_predictions(measured.runs)]


def runs_range(measured: MeasuredSpeeds) -> StepRange:
    """The P10-P90 ratio range of a prediction the profile's runs corrected (:func:`held_out_ratios`)."""
    return held_out_range(held_out_ratios(measured), "recorded runs' measured/predicted step time, each "
                                                     "predicted with the other runs' corrections (the cluster "
                                                     "profile's measured.runs)")


def measured_section(speeds: Speeds, *, precision: Precision, matmul_shape: tuple[int, int], measured_at: str,
                     hosts: list[str], nodes: int, versions: dict[str, str], sources: dict[str, str]
                     ) -> MeasuredSpeeds:
    """A profile's ``measured`` section for speeds the calibration measured."""
    return MeasuredSpeeds(
        precision=precision,
        matmul_tflops=[MatmulRate(rows=rows, tflops=tflops) for rows, tflops in speeds.matmul_tflops],
        matmul_shape=list(matmul_shape), intra_node_gbps=speeds.intra_node_gbps,
        inter_node_gbps=speeds.inter_node_gbps, intra_latency_s=speeds.intra_latency_s,
        inter_latency_s=speeds.inter_latency_s, intra_bus_efficiency=speeds.intra_bus_efficiency,
        inter_bus_efficiency=speeds.inter_bus_efficiency, host_link_gbps=speeds.host_link_gbps,
        **{share: getattr(speeds, share) for share in COLLECTIVE_SHARES},
        device_memory_gb_per_s=speeds.device_memory_gb_per_s, host_memory_gb_per_s=speeds.host_memory_gb_per_s,
        host_optimizer_params_per_s=speeds.host_optimizer_params_per_s, op_overhead_s=speeds.op_overhead_s,
        core_share=speeds.core_share, attention_share=speeds.attention_share, measured_at=measured_at,
        hosts=list(hosts), nodes=nodes, workers=len(hosts),
        versions=dict(versions), sources=dict(sources))


def measured_values(measured: MeasuredSpeeds) -> dict:
    """A profile's ``measured`` section as plain JSON/YAML values (the precision by name)."""
    values = dataclasses.asdict(measured)
    values["precision"] = Precision(measured.precision).value
    return values


def profile_note(measured: MeasuredSpeeds) -> str:
    """Where a profile's speeds come from, in one line."""
    note = (f"measured by `orch calibrate` at {measured.measured_at} on {measured.nodes} node(s), {measured.workers} "
            f"worker(s) (the cluster profile's cluster.measured)")
    runs = current_runs(measured.runs)
    if corrections := run_corrections(measured):
        kinds = sorted({run.kind for run in runs if run.kind})
        note += f"; corrected by {len(runs)} finished run(s): " + ", ".join(
            f"{phase} x{scale:.2f}" for phase, scale in sorted(corrections.items()) if ": " not in phase)
        if kinds:
            note += f" over all of them, and each kind's own for plans of the {len(kinds)} kind(s) they ran"
    if stale := len(measured.runs) - len(runs):
        note += (f"; {stale} recorded run(s) priced under an older split of the step into phases correct nothing "
                 "(run `orch calibrate` again to measure new ones)")
    return note


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


def cluster_speeds(cluster: ClusterSpec, precision: Precision | None = None) -> tuple[Speeds, str]:
    """The speeds to price a plan at on ``cluster``, and a note saying where they come from: the
    cluster profile's measured speeds when it has them for the plan's precision, else the declared
    ones (the accelerator's defaults where the cluster declares none)."""
    measured = cluster.measured
    if measured is None:
        return Speeds.declared(cluster, precision), declared_speeds_note(cluster, precision)
    if precision is not None and Precision(measured.precision).base != Precision(precision).base:
        return Speeds.declared(cluster, precision), (
            f"{declared_speeds_note(cluster, precision)}; the cluster profile's matmuls were measured in "
            f"{Precision(measured.precision).value}, the plan trains in {Precision(precision).value} (`orch calibrate "
            f"plan.precision={Precision(precision).value}` measures them)")
    speeds = profile_speeds(measured)
    if problems := speeds_problems(speeds):
        raise PlanError([Violation("cluster.measured", "; ".join(problems),
                                   "cannot price a plan: the cluster profile was edited or its measurement failed.",
                                   "measure the cluster again with `orch calibrate`, or set cluster.measured=null "
                                   "to use the declared speeds")])
    return dataclasses.replace(speeds, fp8_speedup=fp8_speedup(cluster)), profile_note(measured)


def mfu_peak(cluster: ClusterSpec, precision: Precision) -> tuple[float | None, str]:
    """The dense matmul rate per device a run's MFU is reported against, and where it comes from:
    the cluster profile's fastest measured matmul when it timed them in the plan's precision,
    else None, for each worker to measure its own as it starts.

    A worker's own figure is taken at start, once and briefly, on whatever else the machine runs
    then: on CPU workers another process on the same cores lowers it, and the MFU over it comes
    out too high. The profile's rates are the best of several windows, per worker as the node's
    workers share its cores, on the model's own matmul shape."""
    measured = cluster.measured
    if measured is None or not measured.matmul_tflops:
        return None, "measured by each worker as it started"
    if Precision(measured.precision).base != Precision(precision).base:
        return None, (f"measured by each worker as it started (the cluster profile's matmuls were timed in "
                      f"{Precision(measured.precision).value})")
    peak = max(float(rate.tflops) for rate in measured.matmul_tflops)
    if not math.isfinite(peak) or peak <= 0:
        return None, "measured by each worker as it started (the cluster profile's matmul rates are not usable)"
    return peak, f"the cluster profile's fastest matmul (orch calibrate, {measured.measured_at})"
