"""The cross-entropy of split logits as torch's ``loss_parallel`` allocates it, for the planner's
passes on ``meta``.

With the output head split over the vocabulary (:mod:`orch.plans.parallel.vocab_parallel`), each
rank's loss runs through DTensor's handlers in ``torch/distributed/tensor/parallel/loss.py``
rather than aten's fused kernels, and they hold more at once: the log-softmax keeps the shifted
logits beside its result (aten's kernel writes the result alone), and the backward of the
negative log-likelihood and the log-softmax is computed in one expression,
``(zeros_like(x) with -1 at the targets + exp(x)) * grad``, whose three temporaries of the local
logits' size are alive with the saved log-probabilities. Measured on a 2-rank gloo group by the
process's resident memory (the allocations large enough to be mapped and unmapped one by one):
80 MiB at the peak of a split loss over logits of 16 MiB per rank (the logits included), 64 MiB
for aten's loss over the same local logits (bench/results/split_loss_memory.md).

The worker's tensor tracker (:mod:`orch.launchers.memory_probe`) sees those temporaries only
because it runs DTensor's Python op handlers with itself pushed again (DTensor's dispatch runs
below the tracker's mode); the benchmark above measures them without it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

CROSS_ENTROPY = F.cross_entropy
"""torch's own, the function a torch-function mode is handed for ``F.cross_entropy`` calls."""

_SPLIT_LOSS = contextvars.ContextVar("split_loss", default=False)
"""Whether a cross-entropy measured on meta runs as ``loss_parallel`` runs it (:func:`split_loss_on_meta`)."""


@contextlib.contextmanager
def split_loss_on_meta(enabled: bool = True) -> Iterator[None]:
    """Within it, ``F.cross_entropy`` on meta logits (see :func:`split_cross_entropy`) allocates as
    torch's ``loss_parallel`` does on one tensor-parallel rank's part of the logits."""
    token = _SPLIT_LOSS.set(enabled)
    try:
        yield
    finally:
        _SPLIT_LOSS.reset(token)


def split_cross_entropy(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.cross_entropy(*args, **kwargs)`` as ``loss_parallel`` computes it, when inside
    :func:`split_loss_on_meta`, on meta [tokens, classes] logits, with no class weights or label
    smoothing and a mean or sum; None otherwise (the caller runs the call as it is)."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    call = dict(zip(names, args, strict=False)) | kwargs
    logits, target = call.get("input"), call.get("target")
    plain = (call.get("weight") is None and call.get("size_average") is None and call.get("reduce") is None
             and not call.get("label_smoothing", 0.0) and call.get("reduction", "mean") in ("mean", "sum"))
    if not (_SPLIT_LOSS.get() and plain and isinstance(logits, torch.Tensor) and logits.is_meta and logits.dim() == 2
            and isinstance(target, torch.Tensor) and target.dim() == 1):
        return None
    return _SplitCrossEntropy.apply(logits, target, call.get("ignore_index", -100), call.get("reduction", "mean"))


class _SplitCrossEntropy(torch.autograd.Function):
    """The arithmetic of ``_log_softmax``, ``_nll_loss_forward`` and
    ``_nll_loss_and_log_softmax_backward`` on one rank's logits, in the same order of allocations
    (the all-reductions of the max, the sum and the targets' logits change no sizes)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
        shifted = logits - torch.amax(logits, -1, keepdim=True)
        log_sum_exp = torch.log(torch.sum(torch.exp(shifted), -1, keepdim=True))
        log_probs = shifted - log_sum_exp
        del shifted
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        picked = torch.where(valid, -torch.gather(log_probs, 1, safe.unsqueeze(1)).squeeze(1), 0)
        ctx.save_for_backward(log_probs, safe, valid)
        ctx.mean = reduction == "mean"
        total = picked.sum()
        return total / valid.sum() if ctx.mean else total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        log_probs, safe, valid = ctx.saved_tensors
        if ctx.mean:
            grad = grad / valid.sum()
        grad_input = torch.zeros_like(log_probs)
        grad_input[torch.arange(safe.shape[0], device=safe.device), safe] = -1.0
        scale = torch.where(valid, grad, 0).unsqueeze(1)
        return (grad_input + torch.exp(log_probs)) * scale, None, None, None
