"""What the step-time model needs from a model, counted on ``meta`` in one forward and backward.

One pass under ``torch.utils.flop_counter.FlopCounterMode`` gives the training FLOPs (as
:func:`orch.plans.step_time.flops.training_flops_per_sample` counts them). Forward hooks on the same pass give
what communication depends on: the outputs of the row-parallel layers and the inputs of the
column-parallel ones (tensor-parallel all-reduces) and one repeated layer's output (what crosses a
pipeline stage boundary), and a dispatch mode counts the operations (kernel launches). The FLOPs
with activation checkpointing are counted in a second pass with checkpointing on: torch's
non-reentrant checkpoint stops recomputing once the tensors backward needs are back, so the
recomputation is less than a whole forward, and only counting it gets it right. Nothing is
allocated; the model built once on meta is copied, not rebuilt.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

from orch.plans.memory.estimate import ModelProbe
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS, affine, extrapolate, repeated_stack, shallow_copy
from orch.plans.model.workload import (
    PROBE_SAMPLES,
    MetaBranches,
    ModelInputs,
    call_model,
    checkpoint_units,
    enable_activation_checkpointing,
    move_batch,
    supports_activation_checkpointing,
)
from orch.plans.parallel.tp_plan import shard_module, split_layers
from orch.plans.step_time.cost_model import Gemm, ModelCost
from orch.plans.step_time.memory_traffic import EagerAndFused, MemoryTraffic, fused_attention


class OpCounter(TorchDispatchMode):
    """Counts the aten operations a pass dispatches.

    Each one is a kernel launch with a fixed cost; on CPU workers, where ops run synchronously,
    that cost adds up to a large share of a small model's step.
    """

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


aten = torch.ops.aten
# (batch, m, n, k) of each GEMM kernel from its operands' shapes.
_GEMM_SHAPES = {
    aten.mm.default: lambda a, b: (1, a.shape[0], b.shape[1], a.shape[1]),
    aten.addmm.default: lambda _c, a, b: (1, a.shape[0], b.shape[1], a.shape[1]),
    aten.bmm.default: lambda a, b: (a.shape[0], a.shape[1], b.shape[2], a.shape[2]),
    aten.baddbmm.default: lambda _c, a, b: (a.shape[0], a.shape[1], b.shape[2], a.shape[2]),
}


class GemmRecorder(TorchDispatchMode):
    """The shapes of the GEMM kernels a pass dispatches, in order (cuBLAS runs each as one kernel)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shape = _GEMM_SHAPES.get(func)
        if shape is not None:
            self.shapes.append(tuple(int(d) for d in shape(*args[:3])))
        return func(*args, **(kwargs or {}))


_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def _gemm_pass(module: torch.nn.Module, inputs: ModelInputs, samples: int) -> list[tuple[int, int, int, int]]:
    """GEMM shapes of one forward and loss of ``samples`` samples, attention through the fused
    kernels a GPU runs (not GEMMs of their own). Backward is not run: each forward GEMM
    ``C = A B`` has two backward ones of its FLOPs, ``dA = dC B^T`` and ``dB = A^T dC``
    (:func:`_with_backward`), and the forward alone takes a third of the time to trace."""
    batch = move_batch(inputs.example_batch(samples), "meta")
    # At one sample a BatchNorm in training mode refuses a 1x1 feature map (ResNet-50 on small
    # images): it normalizes by its running statistics instead, with the same GEMMs around it.
    for sub in module.modules():
        if isinstance(sub, _BATCH_NORMS):
            sub.eval()
    with torch.no_grad(), fused_attention(), GemmRecorder() as recorder, MetaBranches():
        inputs.objective(call_model(module, batch), batch)
    return recorder.shapes


# Where a forward GEMM's (batch, m, n, k) go in its two backward GEMMs: dA is (batch, m, k, n),
# dB is (batch, k, n, m); a dimension the micro-batch grows keeps growing under its new name.
_BACKWARD = ({"batch": "batch", "m": "m", "n": "k", "k": "n"}, {"batch": "batch", "m": "k", "n": "n", "k": "m"})


def _with_backward(gemm: Gemm) -> list[Gemm]:
    """A forward GEMM and the two GEMMs of its backward (every operand of a training pass's
    matmuls takes a gradient: weights, activations, attention's queries, keys and values)."""
    dims = {"batch": gemm.batch, "m": gemm.m, "n": gemm.n, "k": gemm.k}
    out = [gemm]
    for moved in _BACKWARD:
        new = {moved[name]: size for name, size in dims.items()}
        out.append(Gemm(new["batch"], new["m"], new["n"], new["k"], grows=moved.get(gemm.grows, "")))
    return out


def _growing(one: list[tuple[int, ...]], two: list[tuple[int, ...]]) -> list[str]:
    """For each GEMM of a pass at one sample, the dimension that is larger at two samples ('' for
    none, or for every GEMM of a pass whose kernels change with the batch)."""
    if len(one) != len(two):
        return [""] * len(one)
    return [next((name for name, x, y in zip(("batch", "m", "n", "k"), a, b, strict=True) if y != x), "")
            for a, b in zip(one, two, strict=True)]


def _gemms(shapes: list[tuple[int, ...]], growing: list[str]) -> tuple[tuple[Gemm, int], ...]:
    """The distinct GEMMs of one sample's forward and backward and how often each runs."""
    counts: dict[Gemm, int] = {}
    for shape, grows in zip(shapes, growing, strict=True):
        for gemm in _with_backward(Gemm(*shape, grows=grows)):
            counts[gemm] = counts.get(gemm, 0) + 1
    return tuple(counts.items())


def _gemms_by_tp(probe: ModelProbe, module: torch.nn.Module, tp_degrees: list[int]) -> dict[int, tuple]:
    """The GEMMs one rank runs at each tensor-parallel degree (its shard on ``meta``), with the
    dimension the micro-batch multiplies: read off the model's pass at one and at two samples,
    GEMM by GEMM. A shard runs the same GEMMs in the same order, narrower, so its pass at one
    sample takes the unsharded model's dimensions (when it runs as many GEMMs)."""
    one = _gemm_pass(copy.deepcopy(module), probe.inputs, 1)
    growing = _growing(one, _gemm_pass(copy.deepcopy(module), probe.inputs, 2))
    found = {1: _gemms(one, growing)}
    if not probe.tp_layer_specs:
        return found
    halves = _shard_pass(probe, module, 2)
    for tp in (t for t in tp_degrees if t > 1):
        shapes = _divided(one, halves, tp) if halves is not None else None
        if shapes is None:
            shapes = _shard_pass(probe, module, tp)
        if shapes is None:  # shapes that do not split tp ways: the search refuses that tp
            continue
        found[tp] = _gemms(shapes, growing if len(shapes) == len(one) else [""] * len(shapes))
    return found


def _shard_pass(probe: ModelProbe, module: torch.nn.Module, tp: int) -> list[tuple[int, ...]] | None:
    """:func:`_gemm_pass` of the model's tp-way shard at one sample (None: it does not split so)."""
    try:
        return _gemm_pass(shard_module(copy.deepcopy(module), probe.tp_layer_specs, tp), probe.inputs, 1)
    except (RuntimeError, ValueError):
        return None


def _divided(whole: list[tuple[int, ...]], halves: list[tuple[int, ...]], tp: int) -> list[tuple[int, ...]] | None:
    """The tp-way shard's GEMMs from the 2-way shard's: the dimensions that halved are divided by
    tp (None when the two passes do not line up, or a dimension does not divide)."""
    if len(whole) != len(halves):
        return None
    shapes = []
    for a, b in zip(whole, halves, strict=True):
        if any(x != y and (2 * y != x or x % tp) for x, y in zip(a, b, strict=True)):
            return None
        shapes.append(tuple(x if x == y else x // tp for x, y in zip(a, b, strict=True)))
    return shapes


def _carry_gemms(shallow: ModelCost, deeper: ModelCost, depth: int) -> dict[int, tuple]:
    """GEMM counts at two shallow depths carried to ``depth`` (:func:`orch.plans.model.depth_scaling.affine`):
    a repeated layer's GEMMs grow with depth, the embedding's and the head's stay."""
    carried = {}
    for tp, gemms in deeper.gemms.items():
        before = dict(shallow.gemms.get(tp, ()))
        carried[tp] = tuple((gemm, affine(before.get(gemm, 0), count, depth)) for gemm, count in gemms)
    return carried


def _checkpointed_pass(module: torch.nn.Module, inputs: ModelInputs) -> tuple[int, int]:
    """(FLOPs, ops) of forward + loss + backward with activation checkpointing on, as
    :func:`orch.plans.step_time.flops.training_flops_per_sample` counts them."""
    enable_activation_checkpointing(module)
    batch = move_batch(inputs.example_batch(PROBE_SAMPLES), "meta")
    with FlopCounterMode(display=False) as counter, OpCounter() as ops, MetaBranches():
        loss = inputs.objective(call_model(module, batch), batch)
        loss.backward()
    return int(counter.get_total_flops()) // PROBE_SAMPLES, ops.ops


def _layer_names(module: torch.nn.Module) -> frozenset[str]:
    """The repeated layers' names as torch's module trackers (and ``FlopCounterMode``) spell them."""
    units = {id(unit) for unit in checkpoint_units(module)}
    root = type(module).__name__
    return frozenset(f"{root}.{name}" for name, sub in module.named_modules() if id(sub) in units)


def _traffic(module: torch.nn.Module, inputs: ModelInputs, *, checkpointing: bool) -> int:
    """Bytes the memory-bound kernels of one sample's forward, loss and backward move
    (:mod:`orch.plans.step_time.memory_traffic`), with the model in a 16-bit precision as mixed-precision
    training runs it (the loss's own fp32 casts stay fp32)."""
    module, batch = _bf16_copy(module, inputs, checkpointing=checkpointing)
    with MemoryTraffic() as traffic:
        _run_pass(module, inputs, batch)
    return traffic.bytes // PROBE_SAMPLES


def _eager_and_fused(module: torch.nn.Module, inputs: ModelInputs, *, checkpointing: bool,
                     ) -> tuple[MemoryTraffic, MemoryTraffic]:
    """One pass's traffic counted eagerly (the bytes outside the repeated layers split off) and with
    the layers' kernels fused as compiled (which needs the layers tracked)."""
    module, batch = _bf16_copy(module, inputs, checkpointing=checkpointing)
    with ModuleTracker() as tracker, EagerAndFused(tracker, _layer_names(module)) as both:
        _run_pass(module, inputs, batch)
    return both.eager, both.fused


def _bf16_copy(module: torch.nn.Module, inputs: ModelInputs, *, checkpointing: bool):
    """A 16-bit copy of ``module`` for a traffic pass, and the probe's batch for it."""
    module = copy.deepcopy(module).to(torch.bfloat16)
    for param in module.parameters():
        param.grad = None  # a fresh step: no accumulation into the gradients of an earlier pass
    if checkpointing:
        enable_activation_checkpointing(module)
    return module, move_batch(inputs.example_batch(PROBE_SAMPLES), "meta", torch.bfloat16)


def _run_pass(module: torch.nn.Module, inputs: ModelInputs, batch) -> None:
    """Forward, loss and backward of ``batch`` under the counters the caller entered, attention fused
    as a GPU runs it."""
    with fused_attention(), MetaBranches():
        loss = inputs.objective(call_model(module, batch), batch)
        loss.backward()


def _outside_layers(module: torch.nn.Module, traffic: MemoryTraffic, flop_counts: dict) -> tuple[int, int, int]:
    """(FLOPs, first-stage bytes, last-stage bytes) of one sample outside the repeated layers.

    The embedding runs before the first layer (forward) and after the last (backward): a pipeline's
    first stage; the head and the loss between the two: its last stage. A model whose layers
    the trackers do not see is taken as all layers (0, 0, 0), the even split over stages."""
    names = _layer_names(module)
    if not names or not any(name in flop_counts for name in names):
        return 0, 0, 0
    inside = sum(sum(flop_counts.get(name, {}).values()) for name in names)
    total = sum(flop_counts.get("Global", {}).values())
    first, last = traffic.outside_layers
    return max(total - inside, 0) // PROBE_SAMPLES, first // PROBE_SAMPLES, last // PROBE_SAMPLES


def _traffic_by_tp(probe: ModelProbe, module: torch.nn.Module, *, checkpointing: bool,
                   whole: int | None = None) -> tuple[int, int]:
    """(bytes at tp=1, the part of them tensor parallelism divides by tp).

    The kernels between a column- and a row-parallel layer (activation functions, attention) work
    on a shard under tp; layer norms, residual adds and the loss stay whole on every rank, as with
    DeepSpeed AutoTP and Megatron-LM without sequence parallelism. Counted on the model and on its
    2-way shard: bytes(tp) = whole + sharded / tp, so the two give both parts. ``whole``: the
    model's own bytes when already counted.
    """
    if whole is None:
        whole = _traffic(module, probe.inputs, checkpointing=checkpointing)
    if not probe.tp_layer_specs:
        return whole, 0
    try:
        half = _traffic(shard_module(copy.deepcopy(module), probe.tp_layer_specs, 2), probe.inputs,
                        checkpointing=checkpointing)
    except (RuntimeError, ValueError):  # a model whose shapes do not split 2 ways: count it all as whole
        return whole, 0
    return whole, min(max(2 * (whole - half), 0), whole)


def measure_model_cost(probe: ModelProbe, tp_degrees: list[int], *, depth_scaled: bool = False,
                       split_head: bool = True) -> ModelCost:
    """Count the model's FLOPs and communication sizes for one sample of the probe's data source.

    ``depth_scaled``: count copies of the model cut to two shallow depths and extrapolate to its
    depth (:mod:`orch.plans.model.depth_scaling`), when its repeated layers are identical: the probe's own
    shallow copies when it has some (``probe.shallow``). Without ``depth_scaled`` the model is
    counted at its full depth (built for that if the probe has not built it).

    A model whose output head ``plan.loss_parallel`` can split is counted a second time with the
    head split, for the plans that split it (``ModelCost.split_head``), unless ``split_head`` is
    false (no plan priced with these counts splits it: the second count costs what the first does).
    """
    cost = _measure(probe, tp_degrees, depth_scaled=depth_scaled)
    if split_head and probe.split_head is not None and any(tp > 1 for tp in tp_degrees):
        cost = dataclasses.replace(cost, split_head=_measure(probe.split_head, tp_degrees, depth_scaled=depth_scaled))
    return cost


def _measure(probe: ModelProbe, tp_degrees: list[int], *, depth_scaled: bool) -> ModelCost:
    """:func:`measure_model_cost` with the probe's tensor-parallel specs as they are."""
    keep = ("seq_len", "param_count", "boundary_per_sample")
    if depth_scaled and probe.shallow is not None:  # the model was never built at its full depth
        cut = probe.shallow
        shallow, deeper = (_count(probe, copy.deepcopy(module), tp_degrees) for module in (cut.shallow, cut.deeper))
        depth = cut.depth
    else:
        stack = repeated_stack(probe.module) if depth_scaled else None
        if stack is None:
            return _count(probe, copy.deepcopy(probe.module), tp_degrees)
        shallow, deeper = (_count(probe, shallow_copy(probe.module, stack, d), tp_degrees) for d in SHALLOW_DEPTHS)
        depth = len(stack)
    return dataclasses.replace(extrapolate(shallow, deeper, depth, keep=keep),
                               gemms=_carry_gemms(shallow, deeper, depth))


def _collective_roles(module: torch.nn.Module, probe: ModelProbe) -> dict[str, str]:
    """Module name -> 'row' (its output all-reduced in forward) or 'column' (its input's gradient
    all-reduced in backward) for the modules tensor parallelism splits: the split layers by their
    kind, but an embedding split over the vocabulary sums its lookups in forward as a row-parallel
    layer does, and a tied head computing its logits from that shard takes its input whole as a
    column-parallel layer does (:mod:`orch.plans.parallel.vocab_parallel`)."""
    roles = {name: "row" if isinstance(module.get_submodule(name), torch.nn.Embedding) else kind
             for name, kind in split_layers(module, probe.tp_layer_specs).items()}
    head = probe.output_head
    if head is not None and head.embedding in roles:
        roles[head.name] = "column"
    return roles


def _count(probe: ModelProbe, module: torch.nn.Module, tp_degrees: list[int]) -> ModelCost:
    """:func:`measure_model_cost` of ``module``, a private copy of the probe's model (maybe cut short)."""
    fresh = copy.deepcopy(module) if supports_activation_checkpointing(module) else None
    kinds = _collective_roles(module, probe)
    sizes = {"row_out": 0, "column_in": 0}
    layers = checkpoint_units(module)
    boundary: list[int] = []
    handles = []

    def on_tp_layer(kind: str):
        def hook(_mod, args, output):
            if kind == "row":
                sizes["row_out"] += output.numel()
            else:
                sizes["column_in"] += args[0].numel()
        return hook

    def leave_layer(_mod, _args, output):
        if not boundary and isinstance(output, torch.Tensor):
            boundary.append(output[0].numel())

    for name, sub in module.named_modules():
        if name in kinds:
            handles.append(sub.register_forward_hook(on_tp_layer(kinds[name])))
    for layer in layers:
        handles.append(layer.register_forward_hook(leave_layer))
    attention = {"kv": 0, "calls": 0, "flops": 0, "shape": ()}
    original_sdpa = F.scaled_dot_product_attention

    def counted_attention(query, key, value, *args, **kwargs):
        # What context parallelism gathers: the keys and values attention is given.
        attention["kv"] += key.numel() + value.numel()
        attention["calls"] += 1
        # Its forward's FLOPs as torch's FLOP counter counts them (two matmuls, the mask ignored).
        groups = query.numel() // (query.shape[-2] * query.shape[-1])
        attention["flops"] += 2 * groups * query.shape[-2] * key.shape[-2] * (query.shape[-1] + value.shape[-1])
        if not attention["shape"]:
            causal = kwargs.get("is_causal", args[2] if len(args) > 2 else False)
            heads = query.shape[-3] if query.dim() >= 3 else 1
            attention["shape"] = (heads, query.shape[-2], key.shape[-2], query.shape[-1], int(bool(causal)))
        return original_sdpa(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = counted_attention
    try:
        batch = move_batch(probe.inputs.example_batch(PROBE_SAMPLES), "meta")
        with FlopCounterMode(display=False) as counter, OpCounter() as op_counter, MetaBranches():
            loss = probe.inputs.objective(call_model(module, batch), batch)
            loss.backward()
    finally:
        F.scaled_dot_product_attention = original_sdpa
        for handle in handles:
            handle.remove()
    flops = int(counter.get_total_flops()) // PROBE_SAMPLES
    # The eager and compiled counts of each pass come from one run of it.
    tracked, compiled = _eager_and_fused(module, probe.inputs, checkpointing=False)
    outside_flops, first_bytes, last_bytes = _outside_layers(module, tracked, counter.get_flop_counts())
    checkpointed, checkpointed_ops = flops, op_counter.ops
    if fresh is not None:
        checkpointed, checkpointed_ops = _checkpointed_pass(fresh, probe.inputs)
    hidden = boundary[0] if boundary else 0
    checkpointable = fresh is not None
    traffic = _traffic_by_tp(probe, module, checkpointing=False, whole=tracked.bytes // PROBE_SAMPLES)
    traffic_ckpt, compiled_ckpt = traffic, compiled
    if checkpointable:
        eager_ckpt, compiled_ckpt = _eager_and_fused(module, probe.inputs, checkpointing=True)
        traffic_ckpt = _traffic_by_tp(probe, module, checkpointing=True, whole=eager_ckpt.bytes // PROBE_SAMPLES)
    return ModelCost(
        seq_len=probe.inputs.tokens_per_sample or 1, flops_per_sample=flops,
        flops_per_sample_checkpointed=checkpointed,
        param_count=probe.stats.param_count,
        tp_param_count={tp: probe.stats_for(tp).param_count for tp in tp_degrees},
        row_parallel_out_per_sample=sizes["row_out"] // PROBE_SAMPLES,
        row_parallel_layers=sum(k == "row" for k in kinds.values()),
        column_parallel_in_per_sample=sizes["column_in"] // PROBE_SAMPLES,
        column_parallel_layers=sum(k == "column" for k in kinds.values()),
        boundary_per_sample=hidden, n_layers=len(layers),
        ops_per_micro_batch=op_counter.ops, ops_per_micro_batch_checkpointed=checkpointed_ops,
        memory_bytes_per_sample=traffic[0], memory_bytes_sharded_per_sample=traffic[1],
        memory_bytes_per_sample_checkpointed=traffic_ckpt[0],
        memory_bytes_sharded_per_sample_checkpointed=traffic_ckpt[1],
        memory_bytes_per_sample_compiled=compiled.bytes // PROBE_SAMPLES,
        memory_bytes_per_sample_checkpointed_compiled=compiled_ckpt.bytes // PROBE_SAMPLES,
        ops_fused_away_per_micro_batch=compiled.kernels_fused_away,
        ops_fused_away_per_micro_batch_checkpointed=compiled_ckpt.kernels_fused_away,
        param_modules=sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False))),
        gemms=_gemms_by_tp(probe, module, tp_degrees),
        flops_outside_layers_per_sample=outside_flops, memory_bytes_first_stage_per_sample=first_bytes,
        memory_bytes_last_stage_per_sample=last_bytes,
        attention_kv_per_sample=attention["kv"] // PROBE_SAMPLES, attention_calls=attention["calls"],
        attention_forward_flops_per_sample=attention["flops"] // PROBE_SAMPLES, attention_shape=attention["shape"],
    )
