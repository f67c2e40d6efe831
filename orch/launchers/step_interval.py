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
    time_s: float = 0.0
    steps: int = 0

    def add(self, loss: float, time_s: float) -> None:
        self.loss += loss
        self.time_s += time_s
        self.steps += 1

    @property
    def mean_loss(self) -> float:
        return self.loss / self.steps

    def rates(self) -> dict[str, float | None]:
        """The mean step time and this rank's sample and token rates, as the report names them."""
        samples_per_s = self.samples_per_step * self.steps / self.time_s
        return {"step_time_s": self.time_s / self.steps, "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None}

    def reset(self) -> None:
        self.loss, self.time_s, self.steps = 0.0, 0.0, 0
