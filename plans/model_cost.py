"""What the step-time model needs from a model, counted on ``meta`` in one forward and backward.

One pass under ``torch.utils.flop_counter.FlopCounterMode`` gives the training FLOPs (as
:func:`plans.flops.training_flops_per_sample` counts them). Forward hooks on the same pass give
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
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from plans.cost_model import Gemm, ModelCost
from plans.depth_scaling import SHALLOW_DEPTHS, affine, extrapolate, repeated_stack, shallow_copy
from plans.estimate import ModelProbe, shard_module
from plans.memory_traffic import MemoryTraffic, fused_attention
from plans.workload import (
    PROBE_SAMPLES,
    MetaBranches,
    ModelInputs,
    call_model,
    checkpoint_units,
    enable_activation_checkpointing,
    move_batch,
    supports_activation_checkpointing,
)


def _tp_kinds(module: torch.nn.Module, layer_specs: list[dict]) -> dict[str, str]:
    """Module name -> 'row' or 'column' for the layers the AutoTP specs shard."""
    patterns = [(re.compile(p), spec.get("partition_type", "column"))
                for spec in layer_specs for p in spec.get("patterns", [])]
    kinds = {}
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "weight", None), torch.nn.Parameter):
            matched = [kind for pattern, kind in patterns if pattern.match(f"{name}.weight")]
            if matched and matched[0] in ("row", "column"):
                kinds[name] = matched[0]
    return kinds


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


def _gemm_pass(module: torch.nn.Module, inputs: ModelInputs, samples: int) -> list[tuple[int, int, int, int]]:
    """GEMM shapes of one forward, loss and backward of ``samples`` samples, attention through the
    fused kernels a GPU runs (not GEMMs of their own)."""
    for param in module.parameters():
        param.grad = None
    batch = move_batch(inputs.example_batch(samples), "meta")
    with fused_attention(), GemmRecorder() as recorder, MetaBranches():
        loss = inputs.objective(call_model(module, batch), batch)
        loss.backward()
    return recorder.shapes


def _gemms(module: torch.nn.Module, inputs: ModelInputs) -> tuple[tuple[Gemm, int], ...]:
    """The distinct GEMMs of one sample's pass and how often each runs, with the dimension the
    micro-batch multiplies: read off the same pass at one and at two samples, GEMM by GEMM."""
    one, two = _gemm_pass(module, inputs, 1), _gemm_pass(module, inputs, 2)
    if len(one) != len(two):  # a pass whose kernels depend on the batch: no dimension is known to grow
        two = one
    counts: dict[Gemm, int] = {}
    for a, b in zip(one, two, strict=True):
        grows = next((name for name, x, y in zip(("batch", "m", "n", "k"), a, b, strict=True) if y != x), "")
        gemm = Gemm(*a, grows=grows)
        counts[gemm] = counts.get(gemm, 0) + 1
    return tuple(counts.items())


def _gemms_by_tp(probe: ModelProbe, module: torch.nn.Module, tp_degrees: list[int]) -> dict[int, tuple]:
    """:func:`_gemms` of one rank at each tensor-parallel degree (its shard on ``meta``)."""
    found = {1: _gemms(copy.deepcopy(module), probe.inputs)}
    for tp in tp_degrees:
        if tp <= 1 or not probe.tp_layer_specs:
            continue
        try:
            found[tp] = _gemms(shard_module(copy.deepcopy(module), probe.tp_layer_specs, tp), probe.inputs)
        except (RuntimeError, ValueError):  # shapes that do not split tp ways: the search refuses that tp
            continue
    return found


def _carry_gemms(shallow: ModelCost, deeper: ModelCost, depth: int) -> dict[int, tuple]:
    """GEMM counts at two shallow depths carried to ``depth`` (:func:`plans.depth_scaling.affine`):
    a repeated layer's GEMMs grow with depth, the embedding's and the head's stay."""
    carried = {}
    for tp, gemms in deeper.gemms.items():
        before = dict(shallow.gemms.get(tp, ()))
        carried[tp] = tuple((gemm, affine(before.get(gemm, 0), count, depth)) for gemm, count in gemms)
    return carried


def _checkpointed_pass(module: torch.nn.Module, inputs: ModelInputs) -> tuple[int, int]:
    """(FLOPs, ops) of forward + loss + backward with activation checkpointing on, as
    :func:`plans.flops.training_flops_per_sample` counts them."""
    enable_activation_checkpointing(module)
    batch = move_batch(inputs.example_batch(PROBE_SAMPLES), "meta")
    with FlopCounterMode(display=False) as counter, OpCounter() as ops, MetaBranches():
        loss = inputs.objective(call_model(module, batch), batch)
        loss.backward()
    return int(counter.get_total_flops()) // PROBE_SAMPLES, ops.ops


def _traffic(module: torch.nn.Module, inputs: ModelInputs, *, checkpointing: bool) -> int:
    """Bytes the memory-bound kernels of one sample's forward, loss and backward move
    (:mod:`plans.memory_traffic`), with the model in a 16-bit precision as mixed-precision
    training runs it (the loss's own fp32 casts stay fp32)."""
    module = copy.deepcopy(module).to(torch.bfloat16)
    for param in module.parameters():
        param.grad = None  # a fresh step: no accumulation into the gradients of an earlier pass
    if checkpointing:
        enable_activation_checkpointing(module)
    batch = move_batch(inputs.example_batch(PROBE_SAMPLES), "meta", torch.bfloat16)
    with fused_attention(), MemoryTraffic() as traffic, MetaBranches():
        loss = inputs.objective(call_model(module, batch), batch)
        loss.backward()
    return traffic.bytes // PROBE_SAMPLES


def _traffic_by_tp(probe: ModelProbe, module: torch.nn.Module, *, checkpointing: bool) -> tuple[int, int]:
    """(bytes at tp=1, the part of them tensor parallelism divides by tp).

    The kernels between a column- and a row-parallel layer (activation functions, attention) work
    on a shard under tp; layer norms, residual adds and the loss stay whole on every rank, as with
    DeepSpeed AutoTP and Megatron-LM without sequence parallelism. Counted on the model and on its
    2-way shard: bytes(tp) = whole + sharded / tp, so the two give both parts.
    """
    whole = _traffic(module, probe.inputs, checkpointing=checkpointing)
    if not probe.tp_layer_specs:
        return whole, 0
    try:
        half = _traffic(shard_module(copy.deepcopy(module), probe.tp_layer_specs, 2), probe.inputs,
                        checkpointing=checkpointing)
    except (RuntimeError, ValueError):  # a model whose shapes do not split 2 ways: count it all as whole
        return whole, 0
    return whole, min(max(2 * (whole - half), 0), whole)


def measure_model_cost(probe: ModelProbe, tp_degrees: list[int], *, depth_scaled: bool = False) -> ModelCost:
    """Count the model's FLOPs and communication sizes for one sample of the probe's data source.

    ``depth_scaled``: count copies of the model cut to two shallow depths and extrapolate to its
    depth (:mod:`plans.depth_scaling`), when its repeated layers are identical: the probe's own
    shallow copies when it has some (``probe.shallow``). Without ``depth_scaled`` the model is
    counted at its full depth (built for that if the probe has not built it).
    """
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


def _count(probe: ModelProbe, module: torch.nn.Module, tp_degrees: list[int]) -> ModelCost:
    """:func:`measure_model_cost` of ``module``, a private copy of the probe's model (maybe cut short)."""
    fresh = copy.deepcopy(module) if supports_activation_checkpointing(module) else None
    kinds = _tp_kinds(module, probe.tp_layer_specs)
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
    try:
        batch = move_batch(probe.inputs.example_batch(PROBE_SAMPLES), "meta")
        with FlopCounterMode(display=False) as counter, OpCounter() as op_counter, MetaBranches():
            loss = probe.inputs.objective(call_model(module, batch), batch)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    flops = int(counter.get_total_flops()) // PROBE_SAMPLES
    checkpointed, checkpointed_ops = flops, op_counter.ops
    if fresh is not None:
        checkpointed, checkpointed_ops = _checkpointed_pass(fresh, probe.inputs)
    hidden = boundary[0] if boundary else 0
    checkpointable = fresh is not None
    traffic = _traffic_by_tp(probe, module, checkpointing=False)
    traffic_ckpt = _traffic_by_tp(probe, module, checkpointing=True) if checkpointable else traffic
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
        param_modules=sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False))),
        gemms=_gemms_by_tp(probe, module, tp_degrees),
    )
