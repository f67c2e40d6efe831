"""A run's predicted step, tracked beside what its steps measure.

`orch train` logs the plan's step as `orch check` predicts it (at the cluster profile's measured
speeds, else the declared ones) as run params, its total, each part and where the speeds came from;
`orch report` sets it beside the measured step time.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orch.plans.step_time.phases import phase_groups
from orch.tracking.profiles import PROFILE_METRIC

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from orch.plans.step_time.cost_model import StepTime

PREDICTED_STEP_PARAM = "step_time.predicted"
"""The prefix of the predicted step's params: ``.total_s`` and ``.<part>_s`` for each part of
:meth:`orch.plans.step_time.cost_model.StepTime.as_dict` (compute, memory, bubble, tp, dp, ...)."""


def predicted_step_params(step: StepTime, speeds: str, phase_scale: dict[str, float] | None = None,
                          kind: str = "") -> dict[str, str]:
    """The plan's predicted step as run params, its total and each part in seconds, ``speeds``: where
    the speeds it was priced at came from (``measured`` by `orch calibrate`, or ``declared``), the
    profile's corrections from finished runs it includes (``phase_scale``, JSON, by phase group), if
    any, and the plan's ``kind`` (:func:`orch.plans.step_time.phases.correction_kind`): the plans
    this run's own phases correct once it is added to a profile."""
    doc = step.as_dict()
    params = {f"{PREDICTED_STEP_PARAM}.total_s": f"{doc['step_time_s']:.6g}", f"{PREDICTED_STEP_PARAM}.speeds": speeds}
    if kind:
        params[f"{PREDICTED_STEP_PARAM}.kind"] = kind
    if phase_scale:
        params[f"{PREDICTED_STEP_PARAM}.phase_scale"] = json.dumps(phase_scale, sort_keys=True)
    params.update({f"{PREDICTED_STEP_PARAM}.{part}_s": f"{seconds:.6g}" for part, seconds in doc["parts_s"].items()})
    return params


PHASE_METRIC = "step_phase"
"""The prefix of the measured phases' metrics: ``step_phase/<phase>_s``, the slowest rank's mean
seconds per sampled step in each phase (:mod:`orch.launchers.step_phases`)."""

@dataclass(frozen=True)
class PhaseComparison:
    """One phase of the step (or a group of them), predicted and measured."""

    name: str
    predicted_s: float
    measured_s: float
    parts: tuple[str, ...]
    """The predicted parts it holds."""

    @property
    def error_s(self) -> float:
        return self.measured_s - self.predicted_s


def compare_phases(parts_s: dict[str, float], phases_s: dict[str, float]) -> list[PhaseComparison]:
    """The predicted parts against the measured phases, grouped as both can be split
    (:mod:`orch.plans.step_time.phases`)."""
    return [PhaseComparison(group.name, sum(parts_s.get(part, 0.0) for part in group.parts),
                            sum(phases_s.get(phase, 0.0) for phase in group.phases), group.parts)
            for group in phase_groups("pipeline" in phases_s)]


def most_wrong(comparisons: list[PhaseComparison]) -> PhaseComparison:
    """The phase whose prediction is furthest off, in seconds."""
    return max(comparisons, key=lambda c: abs(c.error_s))


PROFILED_PARTS = (
    ("compute (matmul, attention)", ("compute",), ("matmul", "attention")),
    ("memory-bound (element-wise, other)", ("memory",), ("elementwise",)),
    ("communication", ("tp", "dp", "pp", "cp"), ("communication",)),
    ("optimizer and offload copies", ("optimizer", "offload", "dp_gather"), ("optimizer", "copies")),
    ("host: framework Python, ZeRO-3 hooks", ("zero3_hooks",), ("host",)),
)
"""(name, predicted parts, profiled kinds of work) that price and measure the same work: a profiled
step (``train.profile_steps``, :mod:`orch.launchers.step_profile`) splits what phase timers cannot,
the matmuls of a backward from its element-wise kernels and its collectives. A pipeline's bubble
is waiting, which no kind of work holds. A profiled step counts all of the optimizer phase as
optimizer work, so ZeRO-1/2's gather of the updated parameters is priced in that row too."""


def compare_parts(parts_s: dict[str, float], kinds_s: dict[str, float]) -> list[PhaseComparison]:
    """The predicted parts against a profiled step's time by kind of work, where either is non-zero."""
    rows = [PhaseComparison(name, sum(parts_s.get(part, 0.0) for part in parts),
                            sum(kinds_s.get(kind, 0.0) for kind in kinds), parts)
            for name, parts, kinds in PROFILED_PARTS]
    return [row for row in rows if row.predicted_s > 0 or row.measured_s > 0]


def profiled_kinds(metrics: dict[str, float]) -> dict[str, float]:
    """The last profiled step's seconds by kind of work, the slowest rank's (``profile/<kind>_s``),
    and its ``wall``."""
    prefix = f"{PROFILE_METRIC}/"
    return {key[len(prefix):-len("_s")]: value for key, value in metrics.items()
            if key.startswith(prefix) and key.endswith("_s") and "/" not in key[len(prefix):]}


def part_comparisons(params: dict[str, str], metrics: dict[str, float], *,
                     uncorrected: bool = False) -> list[PhaseComparison]:
    """A run's predicted parts against its last profiled step's kinds of work ([] when it profiled
    none or tracked no prediction). ``uncorrected``: each part as priced before the profile's
    corrections by phase, which the run's prediction included (a profile's record of the run)."""
    kinds = profiled_kinds(metrics)
    if not kinds or f"{PREDICTED_STEP_PARAM}.total_s" not in params:
        return []
    parts = predicted_parts(params)
    if uncorrected:
        applied = json.loads(params.get(f"{PREDICTED_STEP_PARAM}.phase_scale", "{}"))
        pipelined = any(key.startswith(f"{PHASE_METRIC}/pipeline") for key in metrics)
        group_of = {part: group.name for group in phase_groups(pipelined) for part in group.parts}
        parts = {part: s / applied.get(group_of.get(part, ""), 1.0) for part, s in parts.items()}
    return compare_parts(parts, kinds)


def profiled_part_lines(client: MlflowClient, run_id: str, params: dict[str, str],
                        metrics: dict[str, float]) -> list[str]:
    """The predicted parts beside the last profiled step's kinds of work, naming the part furthest off
    ([] when the run profiled no step or tracked no prediction)."""
    rows = part_comparisons(params, metrics)
    if not rows:
        return []
    kinds = profiled_kinds(metrics)
    history = client.get_metric_history(run_id, f"{PROFILE_METRIC}/wall_s")
    step = max((point.step for point in history), default=None)
    clock = client.get_run(run_id).data.tags.get(f"{PROFILE_METRIC}.clock", "")
    what = {"device": "kernel time", "cpu": "operators' CPU time"}.get(clock, "time")
    lines = [f"profiled step {step}: the slowest rank's {what} by kind of work, {kinds.get('wall', 0.0):.4g} s wall "
             "under the profiler"]
    for row in rows:
        lines.append(f"  {row.name:<36} measured {f'{row.measured_s:.3g} s':>10}  "
                     f"predicted {f'{row.predicted_s:.3g} s':>10}")
    worst = most_wrong(rows)
    ratio = f", {worst.measured_s / worst.predicted_s:.2f}x" if worst.predicted_s > 0 else ""
    lines.append(f"  most wrong part: {worst.name}, {worst.error_s:+.4g} s per step{ratio}")
    return lines


def _later_median(client: MlflowClient, run_id: str, key: str) -> tuple[float, int, int] | None:
    """The median of a metric's later half of logged points (the first steps carry warm-up, the
    memory probe and the allocator's growth), and the first and last step it covers."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda point: point.step)
    if not history:
        return None
    later = history[len(history) // 2:]
    return statistics.median(point.value for point in later), later[0].step, later[-1].step


def predicted_parts(params: dict[str, str]) -> dict[str, float]:
    """The predicted step's parts a run's params hold, in seconds."""
    prefix = f"{PREDICTED_STEP_PARAM}."
    return {key[len(prefix):-len("_s")]: float(value) for key, value in params.items()
            if key.startswith(prefix) and key.endswith("_s") and key != f"{prefix}total_s"}


def measured_phases(client: MlflowClient, run_id: str, metrics: dict[str, float]) -> dict[str, float]:
    """Each measured phase's median over the run's later half of samples."""
    keys = [key for key in metrics if key.startswith(f"{PHASE_METRIC}/") and key.endswith("_s")]
    phases = {}
    for key in keys:
        median = _later_median(client, run_id, key)
        if median is not None:
            phases[key[len(PHASE_METRIC) + 1:-len("_s")]] = median[0]
    return phases


def phase_comparisons(client: MlflowClient, run_id: str, params: dict[str, str],
                      metrics: dict[str, float]) -> list[PhaseComparison]:
    """The run's predicted parts against its measured phases ([] when either is missing)."""
    phases = measured_phases(client, run_id, metrics)
    if f"{PREDICTED_STEP_PARAM}.total_s" not in params or not phases:
        return []
    return compare_phases(predicted_parts(params), phases)


def step_time_lines(client: MlflowClient, run_id: str, params: dict[str, str],
                    metrics: dict[str, float] | None = None) -> list[str]:
    """The plan's predicted step beside the median of the run's later half of logged steps, then
    phase by phase, naming the phase whose prediction is furthest off."""
    predicted = params.get(f"{PREDICTED_STEP_PARAM}.total_s")
    measured = _later_median(client, run_id, "step_time_s")
    if predicted is None or measured is None:
        return []
    median, first, last = measured
    speeds = params.get(f"{PREDICTED_STEP_PARAM}.speeds", "declared")
    lines = [f"step time  measured {median:.4g} s (median of steps {first}-{last}), predicted "
             f"{float(predicted):.4g} s at the {speeds} speeds: measured / predicted {median / float(predicted):.2f}"]
    parts = predicted_parts(params)
    comparisons = phase_comparisons(client, run_id, params, metrics or {})
    if not comparisons:
        largest = sorted(((name, s) for name, s in parts.items() if s > 0), key=lambda item: -item[1])
        return lines + ["           predicted parts: " + ", ".join(f"{name} {s:.3g} s" for name, s in largest)
                        + " (no phase of its steps was timed)"]
    for c in comparisons:
        held = ", ".join(f"{part} {parts[part]:.3g}" for part in c.parts if parts.get(part, 0) > 0)
        lines.append(f"  {c.name:<20} measured {f'{c.measured_s:.3g} s':>10}  predicted {f'{c.predicted_s:.3g} s':>10}"
                     + (f"  ({held})" if held else ""))
    worst = most_wrong(comparisons)
    ratio = f", {worst.measured_s / worst.predicted_s:.2f}x" if worst.predicted_s > 0 else ""
    lines.append(f"  most wrong: {worst.name}, {worst.error_s:+.4g} s per step{ratio} (phases: the slowest "
                 "rank's sampled steps)")
    return lines + profiled_part_lines(client, run_id, params, metrics or {})
