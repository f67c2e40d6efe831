"""Facts about a model read without allocating it: built and run on the ``meta`` device."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
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


def inspect_model(factory: Callable[[], torch.nn.Module], seq_len: int,
                  arguments: Mapping[str, object] | None = None) -> ModelFacts:
    """Build the model on ``meta`` and run one forward pass to check its contract.

    The contract: ``forward(input_ids[B, T]) -> logits[B, T, V]``. Nothing is allocated, so a
    model far larger than this machine is inspected in milliseconds. The model is user code: an
    exception of its constructor or forward becomes a :class:`PlanError` naming the argument its
    message names (``arguments`` is the model's config: ``_target_`` and constructor arguments).
    """
    arguments = arguments or {}
    # Any failure of user code is reported as a config problem, before anything starts.
    with torch.device("meta"):
        try:
            module = factory()
        except Exception as exc:
            raise PlanError([model_refusal(exc, arguments, "refused its arguments")]) from exc
        try:
            logits = module(torch.zeros(1, seq_len, dtype=torch.long))
        except Exception as exc:
            raise PlanError([model_refusal(exc, arguments, f"failed in forward(input_ids[1, {seq_len}]) "
                                           f"(data.seq_len={seq_len})")]) from exc
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


# How much of a model's exception message a violation quotes.
_QUOTED_CHARS = 400


def model_refusal(error: Exception, arguments: Mapping[str, object], what: str) -> Violation:
    """A model's exception as a violation of the argument it names (``model.n_head`` or ``'n_head'``
    in its message), else of the model's ``_target_``."""
    target = str(arguments.get("_target_", "the model"))
    text = " ".join(str(error).split())[:_QUOTED_CHARS] or "(no message)"
    named = _named_argument(text, arguments)
    message = f"{target} {what}: {type(error).__name__}: {text}"
    if named is None:
        return Violation("model._target_", target, message,
                         "fix the model's arguments (model.<name>=...) or the model's code")
    return Violation(f"model.{named}", arguments[named], message, f"change model.{named}")


def _named_argument(text: str, arguments: Mapping[str, object]) -> str | None:
    """The constructor argument ``text`` mentions first, as ``model.<name>`` or ``'<name>'``."""
    found = []
    for name in arguments:
        if name == "_target_":
            continue
        match = re.search(rf"model\.{re.escape(name)}\b|'{re.escape(name)}'", text)
        if match:
            found.append((match.start(), name))
    return min(found)[1] if found else None
