"""Models that fail on purpose, to test how failures are contained and reported."""

from __future__ import annotations

import os
import time

import torch

from orch.workloads.gpt import GPT


class ExplodingGPT(GPT):
    """Trains normally on ``meta`` (so the planner accepts it), then raises on real data."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta":
            raise RuntimeError("boom: deliberately broken model")
        return super().forward(input_ids)


class SetupHangingGPT(GPT):
    """Rank 1 never finishes building the model (a stuck download, a lock never released)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if os.environ.get("RANK") == "1":
            time.sleep(3600)


SLOW_SAMPLES_LEFT = 0
"""Samples :class:`SlowRankTokens` still draws slowly in this process (rank 1's)."""


class SlowRankTokens(torch.utils.data.Dataset):
    """Token windows counting up from a random start (inputs, next-token targets: learnable) whose
    first ``slow_samples`` draws on rank 1 each take ``delay_s`` longer: a rank starved by its data
    path, then no longer."""

    def __init__(self, samples: int = 2048, seq_len: int = 128, vocab_size: int = 256, slow_samples: int = 0,
                 delay_s: float = 0.025):
        global SLOW_SAMPLES_LEFT
        starts = torch.randint(vocab_size, (samples, 1), generator=torch.Generator().manual_seed(0))
        self.tokens = (starts + torch.arange(seq_len + 1)) % vocab_size
        self.delay_s = delay_s
        if os.environ.get("RANK") == "1":
            SLOW_SAMPLES_LEFT = slow_samples

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        global SLOW_SAMPLES_LEFT
        if SLOW_SAMPLES_LEFT > 0:
            SLOW_SAMPLES_LEFT -= 1
            time.sleep(self.delay_s)
        return self.tokens[i, :-1], self.tokens[i, 1:]


class SlowRankGPT(GPT):
    """Rank 1 takes 0.2 s longer for every forward pass (a slow device): a straggler, which its peers
    wait for at the gradient reduction. With :class:`SlowRankTokens` as its data, only once the slow
    draws are over: first the data path is slow, then the device."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta" and os.environ.get("RANK") == "1" and SLOW_SAMPLES_LEFT == 0:
            time.sleep(0.2)
        return super().forward(input_ids)


class SetupFailingGPT(GPT):
    """Rank 1 fails to build the model; rank 0 would wait for it in DeepSpeed's first collective."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if os.environ.get("RANK") == "1":
            raise ValueError("rank 1 cannot build the model")


class CollectiveStallGPT(GPT):
    """Rank 1 enters, in its fourth real forward pass, an all-reduce that rank 0 never joins.

    The classic rank-conditional collective: rank 1 then waits inside gloo for its peer, while
    rank 0 waits inside the gradient all-reduce of its backward pass for rank 1. Both ranks are
    stuck in a collective and neither Python frame sleeps. The stray all-reduce runs on a group
    of its own, so gloo cannot pair it with the gradient all-reduce and fail fast; it waits for
    the group's timeout, as a real deadlock does.
    """

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.side_group = None
        if torch.distributed.is_initialized():  # in a worker; the planner builds the model on meta without one
            # Every rank must create the group, in the same order (it is a collective call itself).
            self.side_group = torch.distributed.new_group(ranks=[0, 1], backend="gloo")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.side_group is not None and torch.distributed.get_rank() == 1:
            CollectiveStallGPT.calls += 1
            if CollectiveStallGPT.calls == 4:
                torch.distributed.all_reduce(torch.ones(1), group=self.side_group)
        return super().forward(input_ids)


class UnpipelinedGPT(GPT):
    """A model that does not offer its layers to a pipeline (like most user models)."""

    pipeline_layers = None


class OutOfMemoryAboveTwo(GPT):
    """Fails like a device out of memory when a real micro-batch has more than 2 samples, so one
    plan of a tuning fails and the others run (``orch tune`` must contain the failure)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.device.type != "meta" and input_ids.shape[0] > 2:
            raise RuntimeError(f"simulated out of memory: micro-batch of {input_ids.shape[0]} samples")
        return super().forward(input_ids)
