"""The planner's count of a loss over logits split over the vocabulary (orch/plans/parallel/split_loss.py)
and of the backward before and after the model's first parameter gradient (FSDP2's root)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.split_loss_memory import planned_peak_bytes
from orch.plans.model.depth_scaling import head_backward_peaks
from orch.plans.parallel.split_loss import _SplitCrossEntropy, split_loss_on_meta

TOKENS, CLASSES = 64, 512
LOGITS = TOKENS * CLASSES * 4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_split_arithmetic_is_cross_entropy_and_its_gradient(reduction):
    """The same loss and gradient as aten's, ignored targets included (what loss_parallel computes)."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, CLASSES, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, CLASSES, (TOKENS,))
    target[::7] = -100
    expected = F.cross_entropy(logits, target, reduction=reduction)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    found = _SplitCrossEntropy.apply(logits, target, -100, reduction)
    (found_grad,) = torch.autograd.grad(found, logits)
    assert torch.allclose(found, expected) and torch.allclose(found_grad, expected_grad)


def test_the_split_loss_holds_one_more_logits_sized_tensor_than_atens():
    """aten: the logits, the log-probabilities saved, the log-probabilities' gradient and the logits'
    at once (4). loss_parallel's joint backward keeps zeros_like(x), exp(x) and their sum beside
    the saved log-probabilities and the logits (5), as bench/results/split_loss_memory.md measures
    on a gloo group by the resident set."""
    # (and a few per-token scalars)
    assert planned_peak_bytes(TOKENS, CLASSES, split=False) / LOGITS == pytest.approx(4, abs=0.01)
    assert planned_peak_bytes(TOKENS, CLASSES, split=True) / LOGITS == pytest.approx(5, abs=0.01)
    # Outside split_loss_on_meta, and for calls it does not model, the call runs as it is.
    with split_loss_on_meta():
        logits = torch.empty(TOKENS, CLASSES, device="meta", requires_grad=True)
        smoothed = F.cross_entropy(logits, torch.zeros(TOKENS, dtype=torch.long, device="meta"), label_smoothing=0.1)
    assert smoothed.grad_fn.name() != "_SplitCrossEntropyBackward"


def test_backward_is_split_at_the_first_parameter_gradient():
    # (activations, parameter gradients) from the loss to the blocks: the loss's backward peaks at
    # 90 before any gradient; the head's gradient arrives with its input's gradient (event 3).
    events = [(50, 0), (90, 0), (70, 0), (60, 0), (40, 8), (30, 8)]
    assert head_backward_peaks(events) == {"loss_backward_peak": 90, "head_backward_peak": 60}
    assert head_backward_peaks([(50, 0), (90, 0)]) == {"loss_backward_peak": 0, "head_backward_peak": 0}
