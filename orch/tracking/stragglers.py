"""Which rank is slow, and in which phase of the step: from the phases every rank times.

In a synchronous step no rank's step time tells a straggler apart: the fast ranks wait for it at
the next collective, so every rank's step takes as long as the slowest one. Where the time goes
does: a rank that computes (or reads its batch) slower spends more time in the phase where that
happens, and the others spend it waiting in the phase that holds the next collective, later in
the step. So the ranks' phases are compared in step order (forward, backward, optimizer step,
what follows), and the first phase in which one rank takes longer than its peers' median (the
ranks of its pipeline stage: stages do different work by design) by more
than ``train.straggler_threshold`` of the median step names that rank; it is reported once it is
named in the same phase ``train.straggler_reports`` reports in a row. A slowdown that ends at a
collective inside the same phase (a rank slow in its backward, whose gradient reduction waits
for it within the backward) is hidden from phase timing and is not named.

Pure: the driver feeds it each logged step's reports (:mod:`orch.run.driver`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from orch.launchers.job import StepReport

STEP_ORDER = ("data_wait", "forward", "backward", "optimizer", "pipeline", "other")
"""The phases in the order a step runs them (:data:`orch.launchers.step_phases.PHASES`)."""


@dataclass(frozen=True)
class SlowPhase:
    """One rank's excess in one phase of one report's steps."""

    rank: int
    phase: str
    excess_s: float
    """Its seconds per step in the phase beyond the ranks' median there."""
    median_step_s: float
    """The ranks' median step time: what the excess is a share of."""

    @property
    def share(self) -> float:
        return self.excess_s / self.median_step_s if self.median_step_s > 0 else 0.0


def slow_phase(reports: list[StepReport], threshold: float, stages: dict[int, int] | None = None
               ) -> SlowPhase | None:
    """The first phase, in step order, in which one rank's time exceeds its peers' median by more
    than ``threshold`` of the median step time, and that rank; None when no rank does (or the
    report timed no phase, or there is one rank). Peers are the ranks of the same pipeline stage
    (``stages``: rank -> stage; all ranks when None): different stages do different work by design."""
    by_stage: dict[int, list[StepReport]] = {}
    for r in reports:
        by_stage.setdefault((stages or {}).get(r.rank, 0), []).append(r)
    found = [slow for group in by_stage.values() if (slow := _slow_phase_among(group, threshold)) is not None]
    return max(found, key=lambda slow: (-STEP_ORDER.index(slow.phase), slow.share), default=None)


def _slow_phase_among(reports: list[StepReport], threshold: float) -> SlowPhase | None:
    timed = [r for r in reports if r.phase_time_s]
    if len(timed) < 2:
        return None
    median_step = statistics.median(r.step_time_s for r in timed)
    for phase in STEP_ORDER:
        times = {r.rank: r.phase_time_s[phase] for r in timed if phase in r.phase_time_s}
        if len(times) < 2:
            continue
        median = statistics.median(times.values())
        rank = max(times, key=times.get)
        excess = times[rank] - median
        if median_step > 0 and excess > threshold * median_step:
            return SlowPhase(rank=rank, phase=phase, excess_s=excess, median_step_s=median_step)
    return None


@dataclass(frozen=True)
class Straggler:
    """A rank named slow in one phase for several reports in a row."""

    rank: int
    phase: str
    excess_s: float
    """Its mean excess over those reports, seconds per step."""
    share: float
    """The same as a share of the ranks' median step time."""
    first_step: int
    last_step: int
    hostname: str = ""

    def message(self) -> str:
        where = f" on {self.hostname}" if self.hostname else ""
        phase = self.phase.replace("_", " ")  # data_wait: "data wait"
        return (f"rank {self.rank}{where} is a straggler: {phase} +{1e3 * self.excess_s:.1f} ms/step "
                f"(+{100 * self.share:.0f}% of the ranks' median step) over the ranks' median, steps "
                f"{self.first_step}-{self.last_step}")


class StragglerWatch:
    """Names a rank once it is the slow one in the same phase ``reports`` reports in a row; names it
    again only after a report without it."""

    def __init__(self, threshold: float, reports: int, hostnames: dict[int, str] | None = None,
                 stages: dict[int, int] | None = None) -> None:
        self.threshold = threshold
        self.reports = max(1, reports)
        self.hostnames = hostnames or {}
        self.stages = stages
        self._streak: list[tuple[int, SlowPhase]] = []
        self._named: tuple[int, str] | None = None

    def observe(self, reports: list[StepReport]) -> Straggler | None:
        """The straggler these reports complete, if any (reports that timed no phase leave the
        streak as it is)."""
        if self.threshold <= 0 or not any(r.phase_time_s for r in reports):
            return None
        found = slow_phase(reports, self.threshold, self.stages)
        if found is None:
            self._streak, self._named = [], None
            return None
        if self._streak and (self._streak[-1][1].rank, self._streak[-1][1].phase) != (found.rank, found.phase):
            self._streak, self._named = [], None
        self._streak.append((reports[0].step, found))
        if len(self._streak) < self.reports or self._named == (found.rank, found.phase):
            return None
        self._named = (found.rank, found.phase)
        window = self._streak[-self.reports:]
        return Straggler(rank=found.rank, phase=found.phase,
                         excess_s=statistics.mean(slow.excess_s for _, slow in window),
                         share=statistics.mean(slow.share for _, slow in window),
                         first_step=window[0][0], last_step=window[-1][0],
                         hostname=self.hostnames.get(found.rank, ""))


def rank_phase_metrics(reports: list[StepReport], threshold: float, stages: dict[int, int] | None = None
                       ) -> dict[str, float]:
    """Every rank's phases as metrics (``step_phase/rank<r>/<phase>_s``) when the ranks of a stage
    differ in a phase by more than ``threshold`` of the median step (the phases tracked otherwise
    are the slowest rank's only); nothing when they do not."""
    if threshold <= 0 or slow_phase(reports, threshold, stages) is None:
        return {}
    from orch.tracking.step_prediction import PHASE_METRIC

    return {f"{PHASE_METRIC}/rank{r.rank}/{phase}_s": seconds for r in reports
            for phase, seconds in r.phase_time_s.items()}
