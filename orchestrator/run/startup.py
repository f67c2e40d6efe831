"""Where the time before the first training report goes, phase by phase.

A run that takes 20 s to show its first step leaves its user guessing whether the plan check, Ray, the
worker processes or DeepSpeed's initialization is to blame. The driver marks the end of each phase
once; `orch train` prints the split beside the time to the first report, and the MLflow run keeps it
as ``startup/<phase>_s`` metrics, so slow starts can be compared across runs and clusters.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

PHASES = {
    "check": "plan check: the live cluster read off Ray when cluster.address is set (connecting to it), "
             "model probe on meta, memory estimate, FLOP count, then the tracking store opened (an embedded Ray "
             "starting and MLflow imported meanwhile)",
    "tracking": "MLflow run created (or resumed), while Ray starts",
    "ray": "the rest of an embedded Ray's start, unless it was ready already",
    "workers": "placement group and one actor process per worker",
    "setup": "DeepSpeed initialization on every worker: process group, model, engine",
    "first_report": "the first train.log_every steps, until their report reached the driver",
}
"""The phases in the order they run, with what each covers."""


@dataclass
class StartupClock:
    """Seconds spent in each start-up phase, each one measured from the end of the one before."""

    started: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    _last: float | None = None

    def mark(self, phase: str) -> None:
        """End ``phase`` now. Only the first time counts: a restart repeats phases, but it is
        not start-up, and once the first report is marked the clock is done."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; known: {', '.join(PHASES)}")
        if phase in self.phases or "first_report" in self.phases:
            return
        now = time.perf_counter()
        self.phases[phase] = now - (self.started if self._last is None else self._last)
        self._last = now

    def metrics(self) -> dict[str, float]:
        return {f"startup/{phase}_s": seconds for phase, seconds in self.phases.items()}


def describe(phases: dict[str, float]) -> str:
    """``check 2.1s, tracking 0.3s, ...`` in the order the phases ran."""
    return ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f}s" for phase, seconds in phases.items())


@contextlib.contextmanager
def in_background(work: Callable[..., T], *args) -> Iterator[Callable[[], T]]:
    """Run ``work(*args)`` in a thread while the block runs; yield ``result()``, which waits for it
    (raising what it raised). Leaving the block waits for it too, so nothing outlives the command."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=getattr(work, "__name__", "work")) \
            as pool:
        yield pool.submit(work, *args).result
