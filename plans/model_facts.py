"""Facts about a model read without allocating it: built and run on the ``meta`` device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plans.errors import PlanError, Violation


@dataclass(frozen=True)
class ModelFacts:
    param_count: int
    """Distinct parameters (tied ones counted once)."""
    trainable_count: int
    output_vocab: int
    """Size of the last dimension of the logits."""
    supports_activation_checkpointing: bool


def inspect_model(factory: Callable[[], torch.nn.Module], seq_len: int) -> ModelFacts:
    """Build the model on ``meta`` and run one forward pass to check its contract.

    The contract: ``forward(input_ids[B, T]) -> logits[B, T, V]``. Nothing is allocated, so a
    model far larger than this machine is inspected in milliseconds.
    """
    try:
        with torch.device("meta"):
            module = factory()
            logits = module(torch.zeros(1, seq_len, dtype=torch.long))
    except Exception as exc:  # any failure of user code is reported as a config problem
        raise PlanError([Violation("model", type(exc).__name__, f"building or running the model failed: {exc}",
                                   "fix the model's arguments, or its forward(input_ids) -> logits")]) from exc
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, seq_len):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise PlanError([Violation("model", shape,
                                   f"forward(input_ids[1, {seq_len}]) must return logits [1, {seq_len}, vocab].",
                                   "return the logits tensor from forward()")])
    params = {id(p): p for p in module.parameters()}.values()
    return ModelFacts(
        param_count=sum(p.numel() for p in params),
        trainable_count=sum(p.numel() for p in params if p.requires_grad),
        output_vocab=int(logits.shape[-1]),
        supports_activation_checkpointing=callable(getattr(module, "gradient_checkpointing_enable", None)),
    )
