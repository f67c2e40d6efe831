"""Bytes the memory-bound kernels of a pass move, counted on ``meta``.

Between the matmuls of a training step run kernels that do little arithmetic per byte: layer
norms, softmax, activations, dropout, residual and bias adds, casts, the loss, and their
backward. In eager PyTorch (what DeepSpeed runs) each is its own kernel, reading its inputs from
device memory and writing its outputs back, so its time is its bytes over the device's memory
bandwidth. A dispatch mode sees every such kernel of one forward and backward with the shapes
and dtypes it runs at, and adds up what it reads and writes:

- matmuls and attention kernels are left out: their time is their FLOPs (:mod:`orch.plans.step_time.flops`);
- views and metadata ops move nothing;
- gathers (an embedding lookup, the loss picking the target's log-probability) read only the
  rows they pick: their outputs and index inputs are counted, not the whole table;
- ops that create a tensor (zeros, ones) write it, and read nothing.

Compiled layers (``plan.compile``: torch.compile of each repeated block) are counted with
``fused=True``, as inductor fuses them: consecutive memory-bound kernels inside a layer, up to the
next matmul or attention kernel, become one kernel, which reads what it did not produce itself and
writes only what outlives it (read by a later kernel, or still alive when the pass ends: saved for
backward, a gradient). An intermediate the fused kernel consumes itself never reaches memory.

Attention is counted as the GPU runs ``scaled_dot_product_attention``: through the fused
flash/memory-efficient kernels, which never write the sequence x sequence scores (on ``meta``
torch would otherwise decompose it into matmuls and a softmax over them). CPU workers' torch has a
fused (flash) attention kernel of its own too.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Matmul-class kernels: compute-bound, priced by their FLOPs instead.
COMPUTE_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
})
# Metadata only: no kernel reads or writes memory.
FREE_OPS = frozenset({
    aten.detach.default, aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int,
    aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.alias.default,
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.scalar_tensor.default,
    aten.lift_fresh.default, aten._local_scalar_dense.default,
})
# Read only the rows they pick (and their indices), write their output.
GATHER_OPS = frozenset({
    aten.embedding.default, aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default, aten.index_select.default,
    aten.gather.default, aten.index.Tensor,
})
# Write a new tensor without reading one.
CREATE_OPS = frozenset({
    aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default, aten.arange.start,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, aten.fill_.Scalar, aten.zero_.default,
})


def _bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


class MemoryTraffic(TorchDispatchMode):
    """Adds up the bytes the memory-bound kernels of a pass read and write (see the module docstring).

    Given a :class:`torch.utils.module_tracker.ModuleTracker` and the tracker's names of the
    model's repeated layers, it also splits off the bytes of the kernels outside those layers: the
    ones before the first layer's first kernel or after the last layer's last one (the embedding,
    forward and backward: a pipeline's first stage) and the ones in between (the head and the loss,
    forward and backward: its last stage).
    """

    def __init__(self, tracker=None, layers: frozenset[str] = frozenset(), *, fused: bool = False):
        super().__init__()
        self.bytes = 0
        self._tracker, self._layers = tracker, layers
        self._segments: list[list] = []  # [inside a layer?, bytes] in the order the kernels run
        self.fused = fused
        """Count the layers' kernels as inductor fuses them (see the module docstring); needs ``tracker``."""
        self.kernels_fused_away = 0
        """Memory-bound kernels that ran inside another one (``fused``): eager's kernels less these."""
        self._run = 0
        self._in_run = False
        self._unwritten: dict[int, tuple[int, int]] = {}
        """Outputs of fused kernels not yet in memory: storage id -> (bytes, the run that produced it)."""

    def __exit__(self, *exc):
        self.finish()
        return super().__exit__(*exc)

    def finish(self) -> None:
        """The pass has ended: what fused kernels produced and is still alive (saved, gradients) was written."""
        self._add(sum(nbytes for nbytes, _ in self._unwritten.values()))
        self._unwritten.clear()

    def _add(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self._tracker is None:
            return
        inside = bool(self._layers & self._tracker.parents)
        if self._segments and self._segments[-1][0] == inside:
            self._segments[-1][1] += nbytes
        else:
            self._segments.append([inside, nbytes])

    @property
    def outside_layers(self) -> tuple[int, int]:
        """(bytes before the first and after the last layer kernel, bytes between them outside any layer)."""
        inside = [i for i, (is_inside, _) in enumerate(self._segments) if is_inside]
        if not inside:
            return 0, 0
        edges = sum(n for i, (is_inside, n) in enumerate(self._segments) if i < inside[0] or i > inside[-1])
        between = sum(n for i, (is_inside, n) in enumerate(self._segments)
                      if inside[0] < i < inside[-1] and not is_inside)
        return edges, between

    def _inside_layer(self) -> bool:
        return self._tracker is not None and bool(self._layers & self._tracker.parents)

    def _materialize(self, inputs: list[torch.Tensor]) -> None:
        """Fused outputs a kernel outside their run reads: written now (once)."""
        for t in inputs:
            found = self._unwritten.pop(id(t.untyped_storage()), None)
            if found is not None:
                self._add(found[0])

    def _fused_kernel(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """A memory-bound kernel inside a compiled layer: reads what its run did not produce."""
        reads = 0
        for t in inputs:
            key = id(t.untyped_storage())
            found = self._unwritten.get(key)
            if found is not None and found[1] == self._run:
                continue  # produced in this fused kernel: never in memory
            if found is not None:
                self._add(self._unwritten.pop(key)[0])
            reads += t.numel() * t.element_size()
        self._add(reads)
        if self._in_run:
            self.kernels_fused_away += 1
        self._in_run = True
        for t in outputs:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._unwritten:
                weakref.finalize(storage, self._unwritten.pop, key, None).atexit = False
            self._unwritten[key] = (t.numel() * t.element_size(), self._run)

    def _end_run(self) -> None:
        if self._in_run:
            self._run += 1
            self._in_run = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs: dict, out) -> None:
        """Count one dispatched kernel, ``func(*args, **kwargs)``, that returned ``out``."""
        if func in FREE_OPS or func.is_view:
            return
        if self.fused:
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func not in COMPUTE_OPS and func not in GATHER_OPS and self._inside_layer():
                self._fused_kernel(inputs, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
                return
            self._materialize(inputs)
            self._end_run()
        if func in COMPUTE_OPS:
            return
        if func in CREATE_OPS:
            self._add(_bytes(out))
        elif func in GATHER_OPS:
            indices = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                       and not t.is_floating_point()]
            self._add(_bytes(out) + _bytes(indices))
        else:
            self._add(_bytes((args, kwargs)) + _bytes(out))


class EagerAndFused(TorchDispatchMode):
    """One pass counted both ways: eagerly (``eager``) and with the layers fused as compiled
    (``fused``), each a :class:`MemoryTraffic` that sees every kernel the pass dispatches, as it
    would in a pass of its own (a pass on ``meta`` dispatches the same kernels each time)."""

    def __init__(self, tracker, layers: frozenset[str]):
        super().__init__()
        self.eager = MemoryTraffic(tracker, layers)
        self.fused = MemoryTraffic(tracker, layers, fused=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.eager.observe(func, args, kwargs, out)
        self.fused.observe(func, args, kwargs, out)
        return out

    def __exit__(self, *exc):
        self.eager.finish()
        self.fused.finish()
        return super().__exit__(*exc)


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` through the fused kernel a GPU picks: flash without a
    mask, memory-efficient with one; neither writes the sequence x sequence scores."""
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: these kernels take whole heads
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask,
                                                                                               float("-inf"))
    bias = attn_mask.expand(*q.shape[:-1], k.shape[-2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def fused_attention():
    """Within it, ``torch.nn.functional.scaled_dot_product_attention`` runs the fused kernels
    (:func:`_fused_attention`) on ``meta``, in the forward and in checkpoint's recomputation alike
    (which runs where a torch function mode does not reach), and anything they refuse as it was."""
    original = F.scaled_dot_product_attention

    def attention(*args, **kwargs):
        try:
            return _fused_attention(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError):
            return original(*args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
