"""The objectives a run can declare (``objective=causal_lm`` / ``classification``).

An objective is any callable ``(outputs, batch) -> scalar loss`` (see :mod:`orch.plans.model.workload`):
the same object computes the training loss, the pipeline's ``loss_fn``, the eval loss and the
planner's measurements on ``meta``. ``metrics(outputs, batch)`` adds what eval reports besides
the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from orch.plans.model.workload import Batch, batch_targets, model_loss, output_tensor


def _targets(batch: Batch, what: str) -> torch.Tensor:
    targets = batch_targets(batch)
    if targets is None:
        raise ValueError(f"the {what} objective needs targets in the batch: an (inputs, targets) pair or a "
                         "'labels' entry of a dict batch")
    return targets


class CausalLM:
    """Next-token cross-entropy, in fp32 whatever the training precision.

    The batch's targets are already shifted (``targets[t]`` is the token after ``inputs[t]``),
    as the token-window sources yield them. A model that computed its own loss (a Hugging Face
    model given ``labels``) is trusted with it.
    """

    name = "causal_lm"
    loss_parallel = True
    """A cross-entropy over the logits' last dimension: torch's ``loss_parallel`` computes it from
    logits split over the vocabulary (:mod:`orch.plans.parallel.vocab_parallel`)."""

    def __call__(self, outputs: Any, batch: Batch) -> torch.Tensor:
        own = model_loss(outputs)
        if own is not None:
            return own
        logits = output_tensor(outputs)
        targets = _targets(batch, "causal_lm")
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Classification:
    """Cross-entropy of the predicted class scores against integer labels; eval reports accuracy."""

    name = "classification"

    def __call__(self, outputs: Any, batch: Batch) -> torch.Tensor:
        own = model_loss(outputs)
        if own is not None:
            return own
        return F.cross_entropy(output_tensor(outputs).float(), _targets(batch, "classification").reshape(-1))

    def metrics(self, outputs: Any, batch: Batch) -> dict[str, torch.Tensor]:
        predicted = output_tensor(outputs).argmax(dim=-1)
        labels = _targets(batch, "classification").reshape(-1)
        return {"accuracy": (predicted == labels).float().mean()}
