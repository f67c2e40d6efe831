"""Attention as the target device's kernel holds it: the kernel torch's dispatch picks per device,
what the meta run saves through it, and a grouped-query Llama measured against a real CPU pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.config import lm_inputs
from orch.plans.memory.activations import attention_kernels, measure_activations
from orch.plans.model.attention import AttentionKernel, SdpaCall, select_kernel
from orch.plans.spec import Accelerator

CPU, GPU = Accelerator.cpu, Accelerator.gpu


def call(dtype=torch.bfloat16, head_dim=64, mask=False, dropout=0.0, heads=8, kv_heads=8) -> SdpaCall:
    return SdpaCall(dtype=dtype, head_dim_qk=head_dim, head_dim_v=head_dim, has_mask=mask, dropout_p=dropout,
                    query_heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize(("accelerator", "sdpa", "kernel"), [
    (GPU, call(), AttentionKernel.flash),
    (GPU, call(kv_heads=2), AttentionKernel.flash),  # grouped-query k/v: flash takes them unexpanded
    (GPU, call(dropout=0.1), AttentionKernel.flash),
    (GPU, call(mask=True), AttentionKernel.efficient),  # flash takes no mask
    (GPU, call(dtype=torch.float32), AttentionKernel.efficient),  # flash is half precision only
    (GPU, call(head_dim=320, mask=True), AttentionKernel.efficient),
    (GPU, call(head_dim=20, dtype=torch.float16, mask=True), AttentionKernel.math),  # not 8-aligned
    (CPU, call(), AttentionKernel.cpu_flash),
    (CPU, call(kv_heads=2, mask=True, dtype=torch.float32), AttentionKernel.cpu_flash),
    (CPU, call(dropout=0.1), AttentionKernel.math),  # the CPU flash kernel has no dropout
])
def test_the_kernel_is_the_one_torchs_dispatch_picks_on_the_device(accelerator, sdpa, kernel):
    assert select_kernel(accelerator, sdpa) == kernel


@pytest.mark.parametrize(("dtype", "dropout", "mask", "kv_heads"), [
    (torch.float32, 0.0, False, 8), (torch.bfloat16, 0.0, True, 2), (torch.bfloat16, 0.1, False, 2)])
def test_the_cpu_choice_agrees_with_what_torch_saves_on_this_machine(dtype, dropout, mask, kv_heads):
    """The CPU rule is checked against torch itself: the math path is the only one whose backward
    node saves a sequence x sequence tensor."""
    b, h, s, d = 2, 8, 64, 16
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, dtype=dtype, requires_grad=True) for _ in range(2))
    attn_mask = torch.ones(s, s, dtype=torch.bool).tril() if mask else None
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=not mask,
                                       enable_gqa=kv_heads != h)
    saved_scores = any(shape[-2:] == (s, s) and len(shape) == 4 and shape[1] == h for shape in shapes)
    kernel = select_kernel(CPU, SdpaCall.of(q, k, v, attn_mask, dropout))
    assert kernel.keeps_scores == saved_scores


def _llama(attn_implementation: str = "sdpa", kv_heads: int = 2):
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=kv_heads, vocab_size=256,
                                  max_position_embeddings=2048, attn_implementation=attn_implementation)
    return lambda: AutoModelForCausalLM.from_config(config)


def _measure(factory, seq_len: int, accelerator: Accelerator) -> int:
    return measure_activations(factory, micro_batch_size=2, inputs=lm_inputs(seq_len), dtype=torch.bfloat16,
                               checkpointing=False, accelerator=accelerator).backward_peak


@pytest.mark.parametrize("accelerator", [CPU, GPU])
def test_fused_attention_keeps_activations_linear_in_the_sequence(accelerator):
    """A grouped-query Llama (Hugging Face's sdpa path passes enable_gqa): no sequence x sequence
    term on either device, so doubling the sequence doubles the bytes; eager attention keeps its
    scores and grows faster."""
    sdpa = _llama()
    assert _measure(sdpa, 1024, accelerator) == pytest.approx(2 * _measure(sdpa, 512, accelerator), rel=0.02)
    eager = _llama("eager")
    assert _measure(eager, 1024, accelerator) > 2.5 * _measure(eager, 512, accelerator)


def test_a_grouped_query_llama_is_measured_on_meta_as_it_runs_on_cpu():
    from orch.launchers.memory_probe import PeakMemoryTracker, live_tensor_bytes
    from orch.plans.model.workload import move_batch

    factory, inputs, seq_len = _llama(), lm_inputs(256), 256
    predicted = measure_activations(factory, micro_batch_size=2, inputs=inputs, dtype=torch.bfloat16,
                                    checkpointing=False, accelerator=CPU)
    torch.manual_seed(0)
    model = factory().to(torch.bfloat16).train()
    train, _ = inputs.data.datasets()
    batch = move_batch(torch.utils.data.default_collate([train[i] for i in range(2)]), "cpu")
    baseline = live_tensor_bytes()
    with PeakMemoryTracker() as tracker:
        inputs.loss(model, batch).backward()
    measured = tracker.peak - baseline
    assert batch[0].shape == (2, seq_len)
    assert abs(predicted.backward_peak_with_grads - measured) / measured < 0.05


def test_the_kernel_assumed_is_named_per_device():
    sdpa = _llama()
    gpu = attention_kernels(sdpa, inputs=lm_inputs(64), dtype=torch.bfloat16, accelerator=GPU).describe(GPU)
    assert gpu == ("scaled_dot_product_attention on gpu: flash kernel; no sequence x sequence scores saved")
    cpu = attention_kernels(sdpa, inputs=lm_inputs(64), dtype=torch.float32, accelerator=CPU).describe(CPU)
    assert cpu == ("scaled_dot_product_attention on cpu: cpu flash kernel; no sequence x sequence scores saved")
    eager = attention_kernels(_llama("eager"), inputs=lm_inputs(64), dtype=torch.bfloat16, accelerator=GPU)
    assert eager.describe(GPU).startswith("no scaled_dot_product_attention call")
