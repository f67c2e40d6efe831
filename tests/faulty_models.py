"""Models that fail on purpose, to test how failures are contained and reported."""

from __future__ import annotations

import os
import time

import torch

from workloads.gpt import GPT


class ExplodingGPT(GPT):
    """Trains normally on ``meta`` (so the planner accepts it), then raises on real data."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta":
            raise RuntimeError("boom: deliberately broken model")
        return super().forward(input_ids)


class HangingGPT(GPT):
    """Rank 1 stops forever in its fourth real forward pass, like a stuck collective or kernel."""

    calls = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta" and os.environ.get("RANK") == "1":
            HangingGPT.calls += 1
            if HangingGPT.calls == 4:
                time.sleep(3600)
        return super().forward(input_ids)
