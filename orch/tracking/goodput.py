"""Goodput: the share of a run's wall time spent training steps that count, and where the rest went.

Operators of large runs manage this number rather than the step time: a run that trains fast but
restarts, re-trains lost steps and waits on checkpoints finishes late. The driver feeds every
attempt's start and every logged step's reports here (:mod:`orch.run.driver`); the ranks report the
seconds they spent stepping, writing checkpoints and evaluating (the slowest rank's count, since the
others wait for it). What remains of each stretch between two reports is the driver's own time
(polling, tracking); start-up is the time from the run's start, or an attempt's, to its first
step. Pure: no MLflow here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orch.launchers.job import StepReport

LOSSES = ("startup", "checkpoint", "evaluation", "restart", "replan", "redone", "other")
"""Where wall time goes besides training, in the order they are shown."""


@dataclass
class Attempt:
    """One attempt of the worker group: seconds by kind."""

    number: int
    started: float
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("training", *LOSSES), 0.0))
    last_report: float | None = None
    ended: float | None = None
    failed: str | None = None
    stopped: str | None = None
    """Why an attempt that did not fail ended early (an elastic run's scale-up)."""


@dataclass
class GoodputLedger:
    """Where a run's wall time goes, attempt by attempt (see the module docstring)."""

    started: float = field(default_factory=time.perf_counter)
    attempts: list[Attempt] = field(default_factory=list)

    def attempt_started(self, now: float | None = None) -> None:
        """A worker group is created. The first attempt's start-up counts from the run's start; a
        later one's time since the previous attempt failed is the restart's."""
        now = time.perf_counter() if now is None else now
        if self.attempts:
            previous = self.attempts[-1]
            previous.seconds["restart"] += now - (previous.ended or now)
            started = now
        else:
            started = self.started
        self.attempts.append(Attempt(number=len(self.attempts) + 1, started=started))

    def reported(self, reports: list[StepReport], *, redone: bool, now: float | None = None) -> None:
        """A logged step's reports arrived: their steps trained for the first time, or again after a
        restart (``redone``), their checkpoints and evaluation; the rest of the stretch since the
        attempt's previous report is the driver's, or the attempt's start-up before its first."""
        now = time.perf_counter() if now is None else now
        attempt = self.attempts[-1]
        stepping = max((r.step_time_s * r.steps for r in reports if r.steps), default=0.0)
        checkpoint = max(r.checkpoint_s for r in reports)
        evaluation = max(r.eval_s for r in reports)
        attempt.seconds["redone" if redone else "training"] += stepping
        attempt.seconds["checkpoint"] += checkpoint
        attempt.seconds["evaluation"] += evaluation
        rest = max(now - (attempt.last_report or attempt.started) - stepping - checkpoint - evaluation, 0.0)
        attempt.seconds["other" if attempt.last_report is not None else "startup"] += rest
        attempt.last_report = now

    def attempt_failed(self, why: str, now: float | None = None) -> None:
        """The attempt's group failed: what it spent since its last report (or its start) is lost to
        the failure, and the restart counts from now."""
        now = time.perf_counter() if now is None else now
        attempt = self.attempts[-1]
        attempt.seconds["restart"] += now - (attempt.last_report or attempt.started)
        attempt.ended, attempt.failed = now, why

    def attempt_stopped(self, why: str, now: float | None = None) -> None:
        """The attempt was ended on purpose (an elastic run returns to its declared plan): accounted as
        a failure is, since the steps after its last report are trained again."""
        self.attempt_failed(why, now)
        attempt = self.attempts[-1]
        attempt.failed, attempt.stopped = None, why

    def replanned(self, seconds: float) -> None:
        """An elastic run waited for devices and searched a new plan for ``seconds`` after the last
        attempt ended: counted as the re-plan's, not the restart's."""
        attempt = self.attempts[-1]
        attempt.seconds["replan"] += seconds
        attempt.ended = (attempt.ended or time.perf_counter()) + seconds

    def totals(self, now: float | None = None) -> dict[str, float]:
        """Seconds by kind over every attempt, ``wall`` since the run's start and ``goodput``, the
        share of it spent training; what no attempt accounts for (the end: export, the last
        tracking) is ``other``."""
        now = time.perf_counter() if now is None else now
        totals = dict.fromkeys(("training", *LOSSES), 0.0)
        for attempt in self.attempts:
            for kind, seconds in attempt.seconds.items():
                totals[kind] += seconds
        wall = now - self.started
        totals["other"] += max(wall - sum(totals.values()), 0.0)
        return {**totals, "wall": wall, "goodput": totals["training"] / wall if wall > 0 else 0.0}

    def metrics(self, now: float | None = None) -> dict[str, float]:
        """The totals as MLflow metrics: ``goodput`` and ``goodput/<kind>_s``."""
        totals = self.totals(now)
        return {"goodput": totals.pop("goodput"), **{f"goodput/{kind}_s": s for kind, s in totals.items()}}

    def as_dict(self, now: float | None = None) -> dict:
        """The totals and each attempt's seconds (``goodput.json`` in the run)."""
        return {"total": self.totals(now),
                "attempts": [{"attempt": a.number, "failed": a.failed, "stopped": a.stopped,
                              "seconds": dict(a.seconds)}
                             for a in self.attempts]}

    def summary(self, now: float | None = None) -> str:
        """``goodput 87% of 42.0 s: training 36.5 s, startup 4.1 s, ...`` (kinds that took no time left out)."""
        totals = self.totals(now)
        parts = [f"{kind} {totals[kind]:.1f} s" for kind in ("training", *LOSSES) if totals[kind] >= 0.05]
        return f"goodput {100 * totals['goodput']:.0f}% of {totals['wall']:.1f} s wall: " + ", ".join(parts)
