"""bf16 matmuls and convolutions on CPUs without bf16 instructions, computed in fp32.

torch runs a bf16 GEMM or convolution on the CPU through oneDNN only where the CPU has bf16
instructions (AVX-512 BF16, AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``). Elsewhere (an
AVX2 laptop or cloud VM) it falls back to reference loops: 13-40x slower than the same op in fp32
on an AVX2 EPYC core, which made a bf16 training step on such a CPU several times slower than the
fp32 one. A bf16 GEMM multiplies bf16 inputs, accumulates in fp32 and rounds the result to bf16.
So does this module's path: bf16 inputs widen to fp32 exactly, the fp32 kernel (MKL, oneDNN)
multiplies and accumulates, and the result is rounded to bf16 once. Only the order of the
additions differs from the reference loop.

Nothing changes where the CPU has the instructions, on accelerators, or in other precisions: the
context manager is then a no-op. A DTensor's (FSDP2's tensor parallelism) reaches this path through
its local shards; mixed dtypes are left to torch, so a dtype mismatch raises just as it would
without this path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

_aten = torch.ops.aten
_WIDENED = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                      _aten.convolution.default, _aten.convolution_backward.default})
"""The ops a training step's GEMMs and convolutions reach torch's CPU kernels through, forward
and backward (``linear`` and ``matmul`` decompose into these before dispatch)."""


@functools.cache
def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU runs bf16 GEMMs and convolutions natively (oneDNN's bf16 path)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def widens_bf16(precision: str, device: Any) -> bool:
    """Whether :func:`bf16_in_fp32` computes this worker's bf16 matmuls in fp32."""
    return precision == "bf16" and getattr(device, "type", str(device)) == "cpu" and not cpu_has_bf16_kernels()


def _widen(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) else value


def _narrow(value: Any) -> Any:
    return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value


def _is_dtensor(cls: type) -> bool:
    from torch.distributed.tensor import DTensor

    return issubclass(cls, DTensor)


class _Bf16ViaFp32(TorchDispatchMode):
    """Runs the ops of :data:`_WIDENED` whose tensors are all plain CPU bf16 tensors in fp32.

    A DTensor's op is handed back to DTensor (``NotImplemented``): its dispatch then runs with
    this mode still on, so the op on its local shards, plain tensors, comes here again. Other
    tensor subclasses (the fake tensors DTensor's sharding propagation runs) go through untouched.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WIDENED:
            if any(_is_dtensor(t) for t in types):
                return NotImplemented
            if all(t is torch.Tensor for t in types):
                tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                if tensors and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
                    return tree_map(_narrow, func(*tree_map(_widen, args), **tree_map(_widen, kwargs)))
        return func(*args, **kwargs)


def bf16_in_fp32(precision: str, device: Any) -> contextlib.AbstractContextManager:
    """While active, this thread's bf16 GEMMs and convolutions run in fp32 and round to bf16 where
    :func:`widens_bf16` says so; otherwise nothing changes.

    Entered around each step and evaluation, not for a whole run: the dispatch mode stack is the
    thread's own, and an actor may run a run's calls on different threads.
    """
    return _Bf16ViaFp32() if widens_bf16(precision, device) else contextlib.nullcontext()
