"""Activation memory of one micro-batch, measured by running the model's own code on ``meta``.

Autograd keeps, between forward and backward, exactly the tensors its nodes save for backward;
``torch.autograd.graph.saved_tensors_hooks`` sees every one of them. Running the forward on the
``meta`` device gives real shapes and dtypes without allocating, so the measurement is exact for
the model's code (whatever attention or MLP it uses) and takes milliseconds even for a model that
would not fit this machine. :func:`gpt_activation_bytes` is the closed form for the built-in GPT,
kept as a cross-check of the measurement.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.graph import _engine_run_backward
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from orch.plans.model.attention import KernelLog, SdpaCall, run_on_meta, select_kernel
from orch.plans.model.depth_scaling import (
    SHALLOW_DEPTHS,
    PassTrace,
    ShallowModels,
    extrapolate,
    head_backward_peaks,
    peaks_at_depth,
    repeated_stack,
    shallow_copy,
)
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import (
    Batch,
    MetaBranches,
    ModelInputs,
    call_model,
    checkpoint_units,
    enable_activation_checkpointing,
    move_batch,
    output_tensor,
)
from orch.plans.parallel.split_loss import CROSS_ENTROPY, split_cross_entropy
from orch.plans.spec import Accelerator, Recompute

ModelOrFactory = torch.nn.Module | Callable[[], torch.nn.Module]


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """Bytes autograd holds for one micro-batch."""

    saved: int
    """Tensors saved for backward by the forward and the loss, plus the logits."""
    recompute_peak: int
    """With checkpointing: what recomputing the largest checkpointed layer in backward saves."""
    forward_peak: int = 0
    """Most bytes of non-parameter tensors alive at once from the start of forward to the loss."""
    backward_peak: int = 0
    """Most bytes alive at once over forward and backward when every parameter gradient leaves as
    soon as autograd produces it (ZeRO-2/3 copy it into their bucket in a hook): saved tensors,
    gradients of activations, recomputed layers and the one parameter gradient being produced."""
    backward_peak_with_grads: int = 0
    """The same peak when parameter gradients stay in ``.grad`` until the optimizer step (ZeRO-0/1),
    gradients included."""
    grads_at_backward_peak: int = 0
    """Bytes of parameter gradients in ``.grad`` at the moment of ``backward_peak_with_grads``."""
    blocks_backward_peak: int = 0
    """``backward_peak`` while backward runs through the repeated layers only (not the loss, the
    head or the embedding): what FSDP2's per-block gathers meet. 0 when the model has no repeated
    layers."""
    later_blocks_backward_peak: int = 0
    """``blocks_backward_peak`` over every repeated layer but the last, the first backward reaches:
    what meets the buffers a block's reduce-scatter leaves to the next block. 0 with one layer."""
    blocks_backward_end: int = 0
    """The bytes alive when backward leaves the first repeated layer (its last): what FSDP2's
    last block reduce-scatter meets, with every other block's gradients sharded by then."""
    loss_backward_peak: int = 0
    """``backward_peak`` from the loss to the model's first parameter gradient: the backward of the
    loss and of whatever follows the model's last parameter, which needs no parameter. FSDP2's
    root, resharded after forward, is gathered again only after it. 0 when no parameter gradient
    follows the loss (then the head's backward is not told apart)."""
    head_backward_peak: int = 0
    """``backward_peak`` from the first parameter gradient to the repeated layers' backward (the
    output head's, with its parameters in use); 0 when :attr:`loss_backward_peak` is."""

    @property
    def peak(self) -> int:
        """Saved bytes plus the one layer recomputed at a time in backward."""
        return self.saved + self.recompute_peak


def partly_checkpointed(none: ActivationBytes, policy: ActivationBytes, share: float) -> ActivationBytes:
    """The activations when only ``share`` of the repeated blocks are checkpointed with a policy
    (``plan.recompute_every_n_layers``), from the measurements with none and with every block.

    Identical blocks save the same bytes each, so the saved bytes and the peaks they carry move
    from none's toward the policy's in proportion to the blocks checkpointed; the embedding, the
    head and the loss save the same either way. Backward still recomputes one checkpointed block
    at a time: the policy's recompute peak. Against the GPT measured with every n-th block
    checkpointed (tests/test_recompute.py), the saved bytes are exact and the peaks 0-25% high:
    the backward peak of an unchecked block sits on all the saved bytes without a recomputed
    block's, so the interpolation errs toward refusing a plan, not toward running out of memory.
    """
    between = {f.name: round(getattr(none, f.name) + share * (getattr(policy, f.name) - getattr(none, f.name)))
               for f in dataclasses.fields(ActivationBytes)}
    return ActivationBytes(**between | {"recompute_peak": policy.recompute_peak})


class _MetaRunsAsOn(MetaBranches):
    """Run a model on meta tensors through the code paths it takes on the plan's accelerator.

    Value branches are taken as :class:`orch.plans.model.workload.MetaBranches` takes them. And every
    ``scaled_dot_product_attention`` call is run through the kernel torch would pick for it on
    ``accelerator`` (:func:`orch.plans.model.attention.select_kernel`): with no real device to choose a
    backend for, SDPA on meta falls back to the math path, which saves the T x T attention matrix
    that the fused kernels on CPU and GPU never keep. The kernels chosen are recorded in ``log``.

    A mode is switched off while its handler runs, so SDPA called from inside a Python function
    torch hands the mode whole (``F.multi_head_attention_forward``: torchvision's ViT and every
    ``nn.MultiheadAttention``) would not reach it; while the mode is on, ``torch.nn.functional``'s
    own name for SDPA routes meta tensors the same way.
    """

    def __init__(self, accelerator: Accelerator = Accelerator.cpu, log: KernelLog | None = None):
        super().__init__()
        self.accelerator = accelerator
        self.log = log if log is not None else KernelLog()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and args and args[0].device.type == "meta":
            return self._attention(*args, **kwargs)
        if func is CROSS_ENTROPY:
            split = split_cross_entropy(args, kwargs)
            if split is not None:
                return split
        return super().__torch_function__(func, types, args, kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        cp = _CONTEXT_PARALLEL.get()
        if cp > 1:
            # The engine's attention over a part of the sequence (orch.plans.parallel.context_parallel),
            # each rank's keys and values standing in for the others' in the gather.
            from orch.plans.parallel.context_parallel import split_attention

            token = _CONTEXT_PARALLEL.set(1)
            try:
                return split_attention(query, key, value, gather=lambda t: torch.cat([t] * cp, dim=2), cp_rank=0,
                                       cp=cp, sdpa=self._attention, attn_mask=attn_mask, dropout_p=dropout_p,
                                       is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                       grouped_keys=self.accelerator != Accelerator.gpu)
            finally:
                _CONTEXT_PARALLEL.reset(token)
        kernel = select_kernel(self.accelerator, SdpaCall.of(query, key, value, attn_mask, dropout_p))
        self.log.record(kernel)
        return run_on_meta(kernel, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, sdpa=_SDPA)

    def _routing(self, query, *args, **kwargs):
        if query.device.type == "meta":
            return self._attention(query, *args, **kwargs)
        return _SDPA(query, *args, **kwargs)

    def __enter__(self):
        F.scaled_dot_product_attention = self._routing
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = _SDPA
        return super().__exit__(*exc)


class _MetaRunsAsOnCpu(_MetaRunsAsOn):
    """:class:`_MetaRunsAsOn` for CPU workers."""

    def __init__(self):
        super().__init__(Accelerator.cpu)


_SDPA = F.scaled_dot_product_attention

_CONTEXT_PARALLEL = contextvars.ContextVar("context_parallel", default=1)
"""The context-parallel degree attention runs at on meta (:func:`context_parallel_on_meta`)."""


@contextlib.contextmanager
def context_parallel_on_meta(cp: int) -> Iterator[None]:
    """Within it, attention measured on meta runs as a rank of ``cp`` context-parallel ranks runs it:
    its queries a part of the sequence, the keys and values gathered whole. Rank 0's part is
    measured: every rank keeps as many tokens and gathers as many keys."""
    token = _CONTEXT_PARALLEL.set(cp)
    try:
        yield
    finally:
        _CONTEXT_PARALLEL.reset(token)


class _SavedTensors:
    """Collects the storages autograd saves, each once, attributed to the checkpointable layer."""

    def __init__(self, parameters: list[torch.nn.Parameter]):
        # Storage objects are held, not just their ids: a Python storage object that is dropped
        # can be freed and its id handed to the wrapper of a different storage, which would then
        # be wrongly deduplicated or excluded.
        self._parameter_storages = {id(s): s for s in (p.untyped_storage() for p in parameters)}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.by_layer: dict[int, int] = {}
        self.current_layer: int | None = None

    def add(self, tensor: torch.Tensor) -> None:
        # The key is the identity of the untyped storage: ``data_ptr()`` is 0 for every meta
        # tensor, and q, k and v saved by attention are three views of one qkv output. PyTorch
        # keeps one Python object per storage alive while it is referenced, so views and the
        # tensor they come from yield the same object (while it is held, see __init__); the
        # whole storage is counted, since a
        # saved view keeps all of it alive.
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._parameter_storages or key in self._storages:
            return  # parameters are counted as model states, not activations
        self._storages[key] = storage
        if self.current_layer is not None:
            self.by_layer[self.current_layer] = self.by_layer.get(self.current_layer, 0) + storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @property
    def total(self) -> int:
        return sum(s.nbytes() for s in self._storages.values())


def _build_on_meta(factory_or_module: ModelOrFactory, dtype: torch.dtype) -> torch.nn.Module:
    """A private meta copy in ``dtype``; a caller's module is never changed."""
    if isinstance(factory_or_module, torch.nn.Module):
        if any(t.device.type != "meta" for t in [*factory_or_module.parameters(), *factory_or_module.buffers()]):
            raise ValueError("saved_activation_bytes needs a module built on the meta device; pass a factory "
                             "instead, so the model is built there without allocating")
        module = copy.deepcopy(factory_or_module)
    else:
        with meta_device():
            module = factory_or_module()
    # DeepSpeed casts the module to the training dtype; activations follow the parameters.
    return module.to(dtype=dtype)


def _example(inputs: ModelInputs, micro_batch_size: int, module: torch.nn.Module) -> Batch:
    """The data source's micro-batch on meta, its floating-point tensors in the model's dtype."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    return move_batch(inputs.example_batch(micro_batch_size), "meta", dtype)


def _measure(module: torch.nn.Module, micro_batch_size: int, inputs: ModelInputs,
             accelerator: Accelerator) -> _SavedTensors:
    saved = _SavedTensors(list(module.parameters()))
    handles = []
    for index, layer in enumerate(checkpoint_units(module)):
        def enter(_mod, _args, index=index):
            saved.current_layer = index

        def leave(_mod, _args, _out):
            saved.current_layer = None

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    batch = _example(inputs, micro_batch_size, module)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), _MetaRunsAsOn(accelerator):
            outputs = call_model(module, batch)
            # The loss as the trainer computes it: the declared objective.
            inputs.objective(outputs, batch)
        # The output is alive while the loss is computed even when no node saved it.
        saved.add(output_tensor(outputs))
    finally:
        for handle in handles:
            handle.remove()
    return saved


class _LiveBytes(TorchDispatchMode):
    """A running total of the bytes of meta storages that operators create, and its maxima.

    Like orch/launchers/memory_probe.py's tracker, but on ``meta``: a storage is counted when an
    operator returns it and uncounted by a ``weakref.finalize`` when it is freed. Parameter
    storages are model states and never counted. Parameter gradients are handed to
    :meth:`grad_ready` by a post-accumulate hook that drops them at once, so the total is what
    ZeRO-2/3 keep (the gradient leaves for the bucket) and ``total + grads`` what ZeRO-0/1 keep.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]):
        super().__init__()
        # Held, not just their ids, for the reason given in _SavedTensors.__init__.
        self._parameter_storages = {id(s): s for s in (p.untyped_storage() for p in parameters)}
        self._sizes: dict[int, int] = {}
        self.current = 0
        self.grads = 0
        self.peak = 0
        self.peak_with_grads = 0
        self.grads_at_peak = 0
        self.trace: list[tuple[int, int]] = []
        """(current, grads) after every allocation."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._see(leaf.untyped_storage())
        return out

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._parameter_storages or key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        finalizer = weakref.finalize(storage, self._freed, key)
        finalizer.atexit = False
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        if self.current + self.grads > self.peak_with_grads:
            self.peak_with_grads, self.grads_at_peak = self.current + self.grads, self.grads
        self.trace.append((self.current, self.grads))

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def grad_ready(self, param: torch.Tensor) -> None:
        self.grads += param.grad.untyped_storage().nbytes()
        param.grad = None


def _live_peaks(module: torch.nn.Module, micro_batch_size: int, inputs: ModelInputs,
                accelerator: Accelerator) -> tuple[int, _LiveBytes, PassTrace]:
    """Run forward, loss and backward on meta; the forward's peak, the tracker after backward and
    the live bytes after every allocation with each repeated layer's part."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    live = _LiveBytes(list(module.parameters()))
    handles = [p.register_post_accumulate_grad_hook(live.grad_ready) for p in parameters]
    layers = checkpoint_units(module)
    forward_marks = [[0, 0] for _ in layers]
    backward_marks = [[0, 0] for _ in layers]
    forward_done = False

    def mark(marks: list[int], at: int):
        def hook(_grad):
            marks[at] = len(live.trace)
        return hook

    for k, layer in enumerate(layers):
        def enter(_mod, args, k=k):
            # Also called when a checkpointed layer is recomputed in backward: marked once.
            if not forward_done:
                forward_marks[k][0] = len(live.trace)
                if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    args[0].register_hook(mark(backward_marks[k], 1))

        def leave(_mod, _args, output, k=k):
            if not forward_done:
                forward_marks[k][1] = len(live.trace)
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(mark(backward_marks[k], 0))

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    batch = _example(inputs, micro_batch_size, module)
    try:
        with live, _MetaRunsAsOn(accelerator):
            outputs = call_model(module, batch)
            loss = inputs.objective(outputs, batch)
            del outputs
            forward_peak = live.peak
            forward_done = True
            forward_end = len(live.trace)
            # The engine is called directly: ``loss.backward()`` and ``torch.autograd.backward`` are
            # themselves torch functions, so the attention-routing mode would be popped for their
            # whole duration and a checkpointed layer would be recomputed on the math path.
            _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                 allow_unreachable=True, accumulate_grad=True)
    finally:
        for handle in handles:
            handle.remove()
    return forward_peak, live, PassTrace(values=live.trace, forward_end=forward_end,
                                         forward=[tuple(m) for m in forward_marks],
                                         backward=[tuple(m) for m in backward_marks])


def _head_backward(trace: PassTrace) -> dict[str, int]:
    """The peaks of backward before the model's first parameter gradient and from it to the
    repeated layers (:func:`head_backward_peaks` of the trace's events in between)."""
    start = trace.forward_end
    stop = trace.backward[-1][0] if trace.backward and trace.backward[-1][0] >= start else len(trace.values)
    return head_backward_peaks(trace.values[start:stop])


def _blocks_backward(trace: PassTrace) -> dict[str, int]:
    """The most activation bytes alive while backward is inside one of the repeated layers, the
    same over all of them but the last, and the bytes at the first allocation after backward
    leaves them (all 0 without repeated layers)."""
    values, inside = trace.values, [i for start, stop in trace.backward for i in range(start, stop)]
    if not inside:
        return {"blocks_backward_peak": 0, "later_blocks_backward_peak": 0, "blocks_backward_end": 0}
    later = [i for start, stop in trace.backward[:-1] for i in range(start, stop)]
    end = trace.backward[0][1]
    return {"blocks_backward_peak": max(values[i][0] for i in inside),
            "later_blocks_backward_peak": max((values[i][0] for i in later), default=0),
            "blocks_backward_end": values[min(end, len(values) - 1)][0]}


def measure_activations(factory_or_module: ModelOrFactory, *, micro_batch_size: int, inputs: ModelInputs,
                        dtype: torch.dtype, checkpointing: bool | str,
                        accelerator: Accelerator = Accelerator.cpu) -> ActivationBytes:
    """Bytes autograd saves for one micro-batch of the model's own code, measured on ``meta``.

    The forward and backward peaks come from running forward, loss and backward on meta under a
    tracker of live storages (:class:`_LiveBytes`): they include what the saved-tensor count
    leaves out, the gradients of activations in backward and the recomputed layer's transients.
    Without checkpointing the recompute peak is 0. With it, the forward of the checkpointed model
    gives what stays saved (each layer's input, the embedding and the head), and the largest
    layer's saved bytes from an uncheckpointed forward give what one layer's recomputation holds
    during backward. A checkpointing model without ModuleLists is charged its whole difference
    as recompute, which is an upper bound. Attention is run through the kernel torch picks on
    ``accelerator`` (:mod:`orch.plans.model.attention`).
    """
    return _measure_pass(factory_or_module, micro_batch_size, inputs, dtype, checkpointing, accelerator)[0]


def measure_activations_depth_scaled(module: torch.nn.Module, *, micro_batch_size: int, inputs: ModelInputs,
                                     dtype: torch.dtype, checkpointing: bool | str,
                                     accelerator: Accelerator = Accelerator.cpu) -> ActivationBytes:
    """:func:`measure_activations` of a deep model from copies cut to two shallow depths.

    The saved bytes are sums over the layers and extrapolate along a line; the peaks come from
    the two passes' traces (:func:`orch.plans.model.depth_scaling.peaks_at_depth`). Counts the full depth
    when the model has no single stack of identical layers or a trace breaks the pattern.
    """
    stack = repeated_stack(module)
    if stack is not None:
        shallow = ShallowModels(depth=len(stack), shallow=shallow_copy(module, stack, SHALLOW_DEPTHS[0]),
                                deeper=shallow_copy(module, stack, SHALLOW_DEPTHS[1]))
        carried = activations_from_shallow(shallow, micro_batch_size=micro_batch_size, inputs=inputs,
                                           dtype=dtype, checkpointing=checkpointing, accelerator=accelerator)
        if carried is not None:
            return carried
    return measure_activations(module, micro_batch_size=micro_batch_size, inputs=inputs, dtype=dtype,
                               checkpointing=checkpointing, accelerator=accelerator)


def activations_from_shallow(shallow: ShallowModels, *, micro_batch_size: int, inputs: ModelInputs, dtype: torch.dtype,
                             checkpointing: bool | str,
                             accelerator: Accelerator = Accelerator.cpu) -> ActivationBytes | None:
    """:func:`measure_activations` at ``shallow.depth`` from the two shallow models' passes; None
    when a trace breaks the pattern :func:`orch.plans.model.depth_scaling.peaks_at_depth` needs."""
    (a, a_trace), (b, b_trace) = (_measure_pass(m, micro_batch_size, inputs, dtype, checkpointing, accelerator)
                                  for m in (shallow.shallow, shallow.deeper))
    peaks = peaks_at_depth(a_trace, b_trace, shallow.depth)
    if peaks is None:
        return None
    return dataclasses.replace(extrapolate(a, b, shallow.depth), **dataclasses.asdict(peaks))


def _measure_pass(factory_or_module: ModelOrFactory, micro_batch_size: int, inputs: ModelInputs, dtype: torch.dtype,
                  checkpointing: bool | str, accelerator: Accelerator) -> tuple[ActivationBytes, PassTrace]:
    plain = _measure(_build_on_meta(factory_or_module, dtype), micro_batch_size, inputs, accelerator)
    module = _build_on_meta(factory_or_module, dtype)
    if checkpointing:
        enable_activation_checkpointing(module, checkpointing)
    forward_peak, live, pass_trace = _live_peaks(module, micro_batch_size, inputs, accelerator)
    peaks = dict(forward_peak=forward_peak, backward_peak=live.peak, backward_peak_with_grads=live.peak_with_grads,
                 grads_at_backward_peak=live.grads_at_peak, **_blocks_backward(pass_trace),
                 **_head_backward(pass_trace))
    if not checkpointing:
        return ActivationBytes(saved=plain.total, recompute_peak=0, **peaks), pass_trace
    checkpointed_module = _build_on_meta(factory_or_module, dtype)
    enable_activation_checkpointing(checkpointed_module, checkpointing)
    checkpointed = _measure(checkpointed_module, micro_batch_size, inputs, accelerator)
    recompute = max(plain.by_layer.values(), default=plain.total - checkpointed.total)
    if Recompute.of(checkpointing) is Recompute.selective:
        # A layer recomputed selectively rebuilds only what it did not keep (its matmul and
        # attention outputs stay saved, and are counted in ``saved`` already).
        recompute = max((kept - checkpointed.by_layer.get(layer, 0) for layer, kept in plain.by_layer.items()),
                        default=max(plain.total - checkpointed.total, 0))
    return ActivationBytes(saved=checkpointed.total, recompute_peak=recompute, **peaks), pass_trace


def attention_kernels(factory_or_module: ModelOrFactory, *, inputs: ModelInputs, dtype: torch.dtype,
                      accelerator: Accelerator) -> KernelLog:
    """The attention kernels a forward of the model runs on ``accelerator``, for ``orch check`` to
    name: one forward of two samples on ``meta``, on a private copy (the kernel does not depend on
    the batch size, and a training-mode BatchNorm refuses a batch of one sample once a ResNet has
    pooled it to 1 x 1)."""
    module = _build_on_meta(factory_or_module, dtype)
    log = KernelLog()
    with _MetaRunsAsOn(accelerator, log):
        call_model(module, _example(inputs, 2, module))
    return log


def saved_activation_bytes(factory_or_module: ModelOrFactory, *, micro_batch_size: int, inputs: ModelInputs,
                           dtype: torch.dtype, checkpointing: bool | str) -> int:
    """Peak activation bytes of one micro-batch: :attr:`ActivationBytes.peak` of the measurement.

    Gradients of activations in backward are transient (one layer's worth) and not included.
    """
    return measure_activations(factory_or_module, micro_batch_size=micro_batch_size, inputs=inputs,
                               dtype=dtype, checkpointing=checkpointing).peak


def gpt_activation_bytes(*, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int,
                         micro_batch_size: int, bytes_per_elem: int, checkpointing: bool | str) -> int:
    """Closed form of :func:`saved_activation_bytes` for orch/workloads/gpt.py.

    Korthikanti et al. (2022) count 34·sbh + 5·a·s²·b bytes per layer at 2 bytes per element
    (s = seq_len, b = micro batch, h = d_model, a = heads). This model has no dropout, which
    removes their two 1-byte masks (sbh each) and the s² dropout terms, and flash attention on
    CPU keeps no s² scores, only a per-row fp32 logsumexp. Per layer, in elements of s·b·h:

    ===============================================  ======
    ln_1 input (LayerNorm saves x)                      1
    qkv input (ln_1 output)                             1
    q, k, v: three views of one storage, qkv output     3
    attention output, also the proj input               1
    ln_2 input                                          1
    fc input (ln_2 output)                              1
    gelu input (fc output)                              4
    mlp proj input (gelu output)                        4
    ===============================================  ======

    16 elements, the paper's 34 bytes less the two dropout masks. The attention output is also
    the proj input because the CPU flash kernel lays its output out as [b, s, a, h/a] when q is a
    transposed view (as here), so ``transpose(1, 2).reshape`` is a view, not a copy. Added: fp32
    statistics, LayerNorm's mean and rstd (2·s·b each, two norms) and attention's logsumexp
    (a·s·b). Outside the layers: the token and position indices (int64), ln_f and lm_head
    inputs, the logits, and the loss's fp32 log-softmax (targets in int64). With checkpointing a
    layer keeps only its input (1) and one layer is recomputed in backward at a time.
    """
    s, b, h = seq_len, micro_batch_size, d_model
    fp32, int64 = 4, 8
    layer_norm_stats = 2 * s * b * fp32
    layer = 16 * s * b * h * bytes_per_elem + 2 * layer_norm_stats + n_head * s * b * fp32
    embedding = s * b * int64 + s * int64  # input_ids (wte) and positions (wpe)
    head = 2 * s * b * h * bytes_per_elem + layer_norm_stats  # ln_f input, lm_head input, ln_f stats
    logits = s * b * vocab_size * bytes_per_elem
    # log_softmax output in fp32, the targets, and nll_loss's scalar total_weight.
    loss = s * b * vocab_size * fp32 + s * b * int64 + fp32
    outside = embedding + head + logits + loss
    if not checkpointing:
        return n_layer * layer + outside
    return n_layer * s * b * h * bytes_per_elem + layer + outside
