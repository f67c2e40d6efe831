"""A step slower than the plan predicts: every rank slow alike, which comparing ranks cannot see.

:mod:`orch.tracking.stragglers` names a rank slower than its peers. When every rank is slow (a
node pool running at a lower clock, a slow interconnect, data loading that starves every rank),
or there is one rank, the peers give no yardstick; the plan's prediction does. Each report's
phases are set against the predicted parts they hold (:mod:`orch.plans.step_time.phases`): a
phase group whose slowest rank takes longer than the prediction allows, for
``train.straggler_reports`` reports in a row, is named with that rank, its host and how far off.

"Allows" is the prediction's own measured error: the top of its P10-P90 range (the ratio of
measured to predicted steps over the cases the cost model was checked on, or over the cluster
profile's runs), plus ``train.straggler_threshold`` of the predicted step. It is only compared
when the prediction is priced at the cluster's measured speeds (`orch calibrate`): at declared
speeds the cost model can be off by more than any slowdown worth a warning (docs/tuner.md), and
`orch report` sets prediction and measurement side by side anyway.

Pure: the driver feeds it each logged step's reports (:mod:`orch.run.driver`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from orch.launchers.job import StepReport
from orch.plans.step_time.phases import OUTSIDE, phase_groups


@dataclass(frozen=True)
class PlanSlowdown:
    """A phase group slower than the plan allows for several reports in a row."""

    phase: str
    """The phase group (``forward and backward``, ``optimizer step``, ``pipeline schedule``)."""
    measured_s: float
    """Its slowest rank's mean seconds per step over those reports."""
    predicted_s: float
    allowed_s: float
    """The most the prediction allowed (its P90 ratio, plus the threshold's share of the step)."""
    rank: int
    """The rank that was slowest in it, the last report."""
    first_step: int
    last_step: int
    hostname: str = ""

    def message(self) -> str:
        where = f" on {self.hostname}" if self.hostname else ""
        return (f"the step is slower than the plan predicts: {self.phase} {1e3 * self.measured_s:.1f} ms/step against "
                f"{1e3 * self.predicted_s:.1f} ms predicted ({self.measured_s / self.predicted_s:.1f}x; its error "
                f"allows up to {1e3 * self.allowed_s:.1f} ms), steps {self.first_step}-{self.last_step}; slowest: "
                f"rank {self.rank}{where}")


class PlanWatch:
    """Names a phase group once it exceeds what the prediction allows ``reports`` reports in a
    row; names it again only after a report within it."""

    def __init__(self, parts_s: dict[str, float], p90_ratio: float, threshold: float, reports: int,
                 hostnames: dict[int, str] | None = None) -> None:
        """``parts_s``: the predicted step's parts (``StepTime.as_dict()["parts_s"]``); ``p90_ratio``:
        the top of the prediction's P10-P90 range over the prediction."""
        self.parts_s = parts_s
        self.step_s = sum(parts_s.values())
        self.p90_ratio = p90_ratio
        self.threshold = threshold
        self.reports = max(1, reports)
        self.hostnames = hostnames or {}
        self._streak: dict[str, list[tuple[int, float, int]]] = {}
        self._named: set[str] = set()

    def observe(self, reports: list[StepReport]) -> PlanSlowdown | None:
        """The slowdown these reports complete, if any (reports that timed no phase leave the
        streaks as they are)."""
        timed = [r for r in reports if r.phase_time_s]
        if self.threshold <= 0 or self.step_s <= 0 or not timed:
            return None
        found = None
        for group in phase_groups(any("pipeline" in r.phase_time_s for r in timed)):
            if group is OUTSIDE:
                continue  # no part is predicted there
            predicted = sum(self.parts_s.get(part, 0.0) for part in group.parts)
            allowed = self.allowed_s(predicted)
            seconds = {r.rank: sum(r.phase_time_s.get(phase, 0.0) for phase in group.phases) for r in timed}
            rank = max(seconds, key=seconds.get)
            if predicted <= 0 or seconds[rank] <= allowed:
                self._streak.pop(group.name, None)
                self._named.discard(group.name)
                continue
            streak = self._streak.setdefault(group.name, [])
            streak.append((reports[0].step, seconds[rank], rank))
            if len(streak) >= self.reports and group.name not in self._named and found is None:
                self._named.add(group.name)
                window = streak[-self.reports:]
                found = PlanSlowdown(phase=group.name, measured_s=statistics.mean(s for _, s, _ in window),
                                     predicted_s=predicted, allowed_s=allowed, rank=rank,
                                     first_step=window[0][0], last_step=window[-1][0],
                                     hostname=self.hostnames.get(rank, ""))
        return found

    def allowed_s(self, predicted_s: float) -> float:
        return predicted_s * self.p90_ratio + self.threshold * self.step_s
