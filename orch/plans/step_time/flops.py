"""Training FLOPs of the actual model code, counted (not guessed) on the ``meta`` device.

``torch.utils.flop_counter.FlopCounterMode`` counts every matmul and attention kernel of a
forward and backward pass; on ``meta`` nothing is allocated or computed, so a 175B model is
counted in seconds. With activation checkpointing the backward pass recomputes the forward,
and those FLOPs are counted too: they are work the devices really do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from orch.plans.model.meta import meta_device
from orch.plans.model.workload import (
    PROBE_SAMPLES,
    MetaBranches,
    ModelInputs,
    call_model,
    enable_activation_checkpointing,
    move_batch,
)


def training_flops_per_sample(factory: Callable[[], torch.nn.Module], inputs: ModelInputs, *,
                              checkpointing: bool | str = False, every_n_layers: int = 1) -> int:
    """FLOPs of forward + objective + backward for one sample of the data source (linear in the batch),
    recomputation included (``checkpointing``: a :class:`orch.plans.spec.Recompute` or a bool, in
    every ``every_n_layers``-th block)."""
    with meta_device():
        module = factory()
        if checkpointing:
            enable_activation_checkpointing(module, checkpointing, every_n_layers)
        batch = move_batch(inputs.example_batch(PROBE_SAMPLES), "meta")
        with FlopCounterMode(display=False) as counter, MetaBranches():
            loss = inputs.objective(call_model(module, batch), batch)
            loss.backward()
    return int(counter.get_total_flops()) // PROBE_SAMPLES
