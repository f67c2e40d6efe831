"""FLOP counting is pure (meta device) and checked against the closed form."""

from __future__ import annotations

import functools

from helpers.config import lm_inputs
from orch.plans.step_time.flops import training_flops_per_sample
from orch.workloads.gpt import GPT


def test_gpt_flops_match_the_closed_form():
    n_layer, d, seq, vocab = 2, 128, 128, 256
    factory = functools.partial(GPT, n_layer=n_layer, d_model=d, n_head=4, seq_len=seq, vocab_size=vocab)
    counted = training_flops_per_sample(factory, lm_inputs(seq))
    # Kaplan et al.: 6 FLOPs per parameter per token for the matmuls (embedding lookups excluded,
    # the tied output head included), plus attention's QK^T and AV: 2 * 2 * seq * d per token
    # per layer forward, three times that with backward (causal masking is not exploited).
    matmul_params = n_layer * 12 * d * d + d * vocab
    attention = 3 * n_layer * 4 * seq * d
    expected = (6 * matmul_params + attention) * seq
    assert abs(counted - expected) / expected < 0.01


def test_checkpointing_adds_one_forward():
    factory = functools.partial(GPT, n_layer=2, d_model=64, n_head=4, seq_len=64)
    plain = training_flops_per_sample(factory, lm_inputs(64))
    recomputed = training_flops_per_sample(factory, lm_inputs(64), checkpointing=True)
    assert plain < recomputed < plain * 4 / 3 * 1.01  # the blocks' forward again, not the head's
