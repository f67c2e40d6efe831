"""Training FLOPs of the actual model code, counted (not guessed) on the ``meta`` device.

``torch.utils.flop_counter.FlopCounterMode`` counts every matmul and attention kernel of a
forward and backward pass; on ``meta`` nothing is allocated or computed, so a 175B model is
counted in seconds. With activation checkpointing the backward pass recomputes the forward,
and those FLOPs are counted too: they are work the devices really do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode


def training_flops_per_sample(factory: Callable[[], torch.nn.Module], seq_len: int, *,
                              checkpointing: bool = False) -> int:
    """FLOPs of forward + loss + backward for one sample of ``seq_len`` tokens (linear in the batch)."""
    with torch.device("meta"):
        module = factory()
        if checkpointing:
            module.gradient_checkpointing_enable()
        inputs = torch.zeros(1, seq_len, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            logits = module(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), inputs.reshape(-1))
            loss.backward()
    return int(counter.get_total_flops())
