"""Where a training step's time goes, by phase, on sampled steps.

Every engine's ``train_step`` calls its ``milestone`` callback when a phase ends, naming it
(:data:`PHASES`): the driver's hang detection counts the calls, and this clock times them. It
times only sampled steps (one per ``train.log_every`` steps, never the memory-probe step), and on
a GPU it waits for the device at each phase's end only on those steps, since timing a phase of
asynchronous kernels needs a synchronisation that would otherwise cost every step its overlap.
What no phase covers (the step's own bookkeeping, the loss read back) is ``other``. The time a
step waits for its next batch (the worker's iterator over the data, wherever the engine draws it)
is taken out of the phase it fell in and counted as ``data_wait``: a rank starved by its data is
told apart from a slow device.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASES = ("data_wait", "forward", "backward", "optimizer", "pipeline", "other")
"""The phases a report can hold: ``data_wait`` (drawing the step's batches from the data
iterator), ``forward`` (the loss computed), ``backward``
(gradients, and the gradient reduction engines run inside it), ``optimizer`` (the step, and for
offload the copies it makes), ``pipeline`` (a pipeline schedule that runs forward, backward and the
step in one call) and ``other``. A milestone without a phase counts as ``other``."""


class PhaseClock:
    """Times the phases of sampled steps and keeps their sums until :meth:`take`."""

    def __init__(self, every: int, synchronize: Callable[[], None] | None = None) -> None:
        self.every = max(1, every)
        self.synchronize = synchronize
        self.sampling = False
        self.last = 0.0
        self.totals: dict[str, float] = {}
        self.samples = 0
        self._waited = 0.0
        """Seconds of the running phase spent waiting for data (:meth:`data_wait`)."""

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def begin(self, step: int, *, skip: bool = False) -> None:
        """Step ``step`` starts; it is timed when it is a sampled one and not ``skip`` (the
        memory-probe step, which its tracker slows down)."""
        self.sampling = step % self.every == 0 and not skip
        if self.sampling:
            self.last = self._now()

    def data_wait(self, seconds: float) -> None:
        """``seconds`` of the running phase went to drawing a batch."""
        if self.sampling:
            self._waited += seconds

    def milestone(self, phase: str = "") -> None:
        """The phase ``phase`` just ended."""
        if not self.sampling:
            return
        now = self._now()
        name = phase if phase in PHASES else "other"
        waited = min(self._waited, now - self.last)
        self.totals[name] = self.totals.get(name, 0.0) + now - self.last - waited
        if waited > 0:
            self.totals["data_wait"] = self.totals.get("data_wait", 0.0) + waited
        self._waited = 0.0
        self.last = now

    def end(self) -> None:
        """The step ended: what followed its last milestone is ``other``."""
        if not self.sampling:
            return
        self.milestone("other")
        self.samples += 1
        self.sampling = False

    def take(self) -> dict[str, float]:
        """Mean seconds per sampled step in each phase since the last call (empty when no step was
        sampled), and start over."""
        means = {phase: total / self.samples for phase, total in self.totals.items()} if self.samples else {}
        self.totals, self.samples = {}, 0
        return means


SAMPLE_EVERY_ON_GPUS = 10
"""On GPUs at most one step in this many is timed by phase (each of its phases ends in a
synchronisation); CPU workers run synchronously and time one step per report."""


def phase_clock(log_every: int, cuda_device=None) -> PhaseClock:
    """The clock of a rank whose device is ``cuda_device`` (None for a CPU worker)."""
    if cuda_device is None:
        return PhaseClock(log_every)
    import torch

    return PhaseClock(max(log_every, SAMPLE_EVERY_ON_GPUS), lambda: torch.cuda.synchronize(cuda_device))
