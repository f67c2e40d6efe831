"""Which kernel ``scaled_dot_product_attention`` runs on the target device, and running it on meta.

What attention keeps for backward depends on the kernel torch picks, not on the model's code:
the fused kernels (flash, memory-efficient, cuDNN, the CPU flash kernel) save q, k, v, the output
and a per-row fp32 logsumexp, while the math fallback saves the sequence x sequence scores and
probabilities (in fp32) and, with dropout, their mask. On ``meta`` there is no device to choose
for, so torch would always take the math path and overstate attention by a factor growing with
the sequence. :func:`select_kernel` repeats torch's own dispatch for the plan's accelerator
(``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp`` for CPU, ``cuda/sdp_utils.cpp`` for
CUDA) and :func:`run_on_meta` calls that kernel's own operator on the meta tensors, so autograd
saves exactly what it saves on the device.

GPUs are taken to be sm80 or newer (A100, H100 and later): the devices bf16 training runs on.
cuDNN's attention, which recent torch prefers on H100, keeps the same tensors as flash (the
output and fp32 softmax statistics), so it is measured as flash.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from orch.plans.spec import Accelerator


class AttentionKernel(str, Enum):
    """An implementation of ``scaled_dot_product_attention``, by what it saves for backward."""

    flash = "flash"
    """CUDA flash attention (or cuDNN): q, k, v, output, logsumexp; grouped-query k/v unexpanded."""
    efficient = "memory-efficient"
    """CUDA memory-efficient attention: q, k, v, output, logsumexp and the additive mask, if any."""
    cpu_flash = "cpu flash"
    """The CPU flash kernel: q, k, v, output, logsumexp and the additive mask, if any."""
    math = "math"
    """The unfused fallback: the scores and probabilities (sequence x sequence, fp32) are saved."""

    @property
    def keeps_scores(self) -> bool:
        """Whether the kernel saves the sequence x sequence attention matrix for backward."""
        return self is AttentionKernel.math


_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class SdpaCall:
    """The facts of one call that torch's kernel choice reads."""

    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    has_mask: bool
    dropout_p: float
    query_heads: int
    kv_heads: int
    aligned_storage: bool = True
    """q, k and v start at storage offsets the CUDA memory-efficient kernel can read (sm80+:
    offset x element size a multiple of 16 bytes for half precision, 16 for fp32)."""

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float) -> SdpaCall:
        alignment = (8 if query.dtype in _HALF else 4) * query.element_size()
        aligned = all(t.storage_offset() * t.element_size() % alignment == 0 for t in (query, key, value))
        return cls(dtype=query.dtype, head_dim_qk=query.shape[-1], head_dim_v=value.shape[-1],
                   has_mask=attn_mask is not None, dropout_p=float(dropout_p), query_heads=query.shape[-3],
                   kv_heads=key.shape[-3], aligned_storage=aligned)


def select_kernel(accelerator: Accelerator, call: SdpaCall) -> AttentionKernel:
    """The kernel torch dispatches ``call`` to on ``accelerator``, by torch's own constraints.

    CPU (``use_flash_attention_cpp``): flash for float, double, bf16 and fp16 with equal head
    dimensions and no dropout; masks and grouped-query k/v are supported. CUDA sm80+
    (``can_use_flash_attention``, ``can_use_mem_efficient_attention``): flash for fp16/bf16 with
    no mask and equal head dimensions up to 256; else memory-efficient for fp16/bf16/fp32 with
    head dimensions a multiple of 8 (half) or 4 (fp32) and aligned storage; else math. Both
    fused CUDA kernels take grouped-query k/v and dropout.
    """
    if call.query_heads % max(call.kv_heads, 1):
        return AttentionKernel.math
    if accelerator == Accelerator.cpu:
        flash = (call.dtype in (torch.float32, torch.float64, *_HALF) and call.dropout_p == 0.0
                 and call.head_dim_qk == call.head_dim_v)
        return AttentionKernel.cpu_flash if flash else AttentionKernel.math
    if call.dtype in _HALF and not call.has_mask and call.head_dim_qk == call.head_dim_v <= 256:
        return AttentionKernel.flash
    alignment = 8 if call.dtype in _HALF else 4
    if (call.dtype in (torch.float32, *_HALF) and call.head_dim_qk % alignment == 0
            and call.head_dim_v % alignment == 0 and call.aligned_storage):
        return AttentionKernel.efficient
    return AttentionKernel.math


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive float mask SDPA turns it into before any fused kernel
    (``convert_boolean_attn_mask``): a new tensor of the query's dtype, which the kernel saves."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)


def run_on_meta(kernel: AttentionKernel, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False, sdpa=F.scaled_dot_product_attention) -> torch.Tensor:
    """``scaled_dot_product_attention`` on meta tensors through ``kernel``'s own operator.

    ``sdpa`` is torch's function itself (a caller that has replaced ``F``'s name passes the
    original), used for the math path, which is what torch runs on meta anyway.
    """
    if kernel == AttentionKernel.math:
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    mask = _additive_mask(attn_mask, query.dtype)
    if kernel == AttentionKernel.cpu_flash:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    if kernel == AttentionKernel.flash:
        # The CUDA path pads the head dimension to a multiple of 8 (``pad_last_dim``); the padded
        # copies are what the kernel saves.
        head_dim = query.shape[-1]
        pad = -head_dim % 8
        if pad:
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        scale = scale if scale is not None else 1 / math.sqrt(head_dim)
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                 scale=scale)[0]
        return out[..., :head_dim] if pad else out
    if mask is not None:
        # ``preprocess_mask``: the bias is expanded to [batch, heads, queries, keys] and, when its
        # rows are not 16-element aligned, copied into a padded tensor (``pad_bias``).
        mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if mask.stride(-2) % 16:
            mask = F.pad(mask, (0, -mask.shape[-1] % 16))[..., :key.shape[2]]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, query.requires_grad or key.requires_grad or value.requires_grad, dropout_p,
        is_causal, scale=scale)[0]


class KernelLog:
    """How many calls of a measured pass went to each kernel."""

    def __init__(self):
        self.calls: Counter[AttentionKernel] = Counter()

    def record(self, kernel: AttentionKernel) -> None:
        self.calls[kernel] += 1

    def describe(self, accelerator: Accelerator) -> str:
        """One line for ``orch check``: the kernels assumed, and what that means for memory."""
        if not self.calls:
            return ("no scaled_dot_product_attention call: whatever attention the model computes itself is "
                    "measured as it runs (an eager softmax keeps its sequence x sequence scores)")
        names = ", ".join(f"{k.value}" + (f" ({n} calls)" if len(self.calls) > 1 else "")
                          for k, n in self.calls.most_common())
        scores = ("sequence x sequence scores saved" if any(k.keeps_scores for k in self.calls)
                  else "no sequence x sequence scores saved")
        return f"scaled_dot_product_attention on {accelerator.value}: {names} kernel; {scores}"
