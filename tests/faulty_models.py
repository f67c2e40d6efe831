"""Models that fail on purpose, to test how failures are contained and reported."""

from __future__ import annotations

import torch

from workloads.gpt import GPT


class ExplodingGPT(GPT):
    """Trains normally on ``meta`` (so the planner accepts it), then raises on real data."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta":
            raise RuntimeError("boom: deliberately broken model")
        return super().forward(input_ids)
