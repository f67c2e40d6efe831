"""The steps between two reports: what a report averages over them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class Interval:
    """The optimizer steps since the last report: their summed loss and time on this rank."""

    samples_per_step: int
    """Samples one rank takes per optimizer step (micro-batch size times accumulation steps)."""
    tokens_per_sample: int | None
    """Tokens per sample for a token workload; None reports no token rate."""
    loss: float = 0.0
    losses: int = 0
    time_s: float = 0.0
    steps: int = 0
    """Steps whose time the rates are made of."""
    untimed_s: float = 0.0
    """Time of the steps left out of the rates (a step under the profiler), used only when no other step is left."""
    untimed: int = 0

    def add(self, loss: float, time_s: float, *, timed: bool = True) -> None:
        """A step's loss and time; an untimed step's time (one slowed by the profiler) stays out of the
        rates unless the interval has no other step."""
        self.loss += loss
        self.losses += 1
        if timed:
            self.time_s += time_s
            self.steps += 1
        else:
            self.untimed_s += time_s
            self.untimed += 1

    @property
    def mean_loss(self) -> float:
        return self.loss / self.losses

    def rates(self) -> dict[str, float | None]:
        """The mean step time and this rank's sample and token rates, as the report names them."""
        steps, time_s = (self.steps, self.time_s) if self.steps else (self.untimed, self.untimed_s)
        samples_per_s = self.samples_per_step * steps / time_s
        return {"step_time_s": time_s / steps, "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None}

    @property
    def timed_steps(self) -> int:
        """The steps :meth:`rates` averaged."""
        return self.steps or self.untimed

    def reset(self) -> None:
        self.loss, self.losses, self.time_s, self.steps, self.untimed_s, self.untimed = 0.0, 0, 0.0, 0, 0.0, 0
