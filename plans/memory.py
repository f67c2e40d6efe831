"""How many bytes one rank needs: model states, ZeRO buffers and an allocator reserve.

Everything here is arithmetic on counts, so the planner can check a plan for a model far larger
than this machine in microseconds. The byte counts follow what DeepSpeed 0.19 actually allocates
(``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``), not a textbook simplification;
where the two differ, the comment next to the number says which allocation it stands for.

Notation in comments: Ψ all parameters, Φ the trainable ones, N the data-parallel degree, b the
bytes of one element in the training precision (4 for fp32, 2 for bf16/fp16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from plans.spec import Accelerator, Offload, OptimizerName, Precision

# Why 10%: PyTorch's CUDA caching allocator rounds every block up (512 B small blocks, 2 MiB
# segments for large ones) and cannot hand a free block in one segment to a request that only
# fits across two, so the memory it reserves exceeds the bytes of live tensors. ZeRO's flat
# buffers are few and large, which keeps this waste small; 10% is a reserve measured usage
# rarely exceeds without ``expandable_segments``. On CPU there is no caching allocator: large
# tensors are mmap'ed and returned to the OS on free, so no reserve is added there.
FRAGMENTATION_RESERVE = 0.10

# DeepSpeed's defaults for settings ``launchers/ds_config.py`` does not write out.
# deepspeed/runtime/engine.py: MEMORY_OPT_ALLREDUCE_SIZE, the bucket of the stage-0 all-reduce.
_STAGE0_ALLREDUCE_BUCKET = 500_000_000
# deepspeed/runtime/zero/config.py: sub_group_size, the optimizer-step granularity of stage 3.
_STAGE3_SUB_GROUP_SIZE = 1_000_000_000

# The fp32 master weights and gradients the optimizer works on.
_FP32 = 4


def bytes_per_element(precision: Precision) -> int:
    """Bytes of one parameter, gradient or activation element in the training precision."""
    return _FP32 if precision == Precision.fp32 else 2


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """Parameter counts of a built model, all the memory model needs to know about it."""

    param_count: int
    """Distinct parameters; a tied weight (embedding = lm_head) is counted once."""
    trainable_count: int
    """Parameters with ``requires_grad``: only these have gradients and optimizer states."""
    largest_layer_params: int
    """Most parameters owned directly by one module; ZeRO-3 gathers one such module whole."""


def model_stats(module: torch.nn.Module) -> ModelStats:
    """Count the parameters of ``module``; works on a model built on the ``meta`` device.

    Tied parameters are the same ``Parameter`` object reached from two modules, so they are
    deduplicated by identity (``data_ptr`` would do too on a real device, but is 0 on meta).
    """
    distinct = {id(p): p for p in module.parameters()}.values()
    # ZeRO-3 fetches parameters per module (its hooks gather ``parameters(recurse=False)``), so
    # the largest such set is what must fit gathered at once; DeepSpeed's own estimator
    # (stage3.model_to_params) measures it the same way.
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return ModelStats(
        param_count=sum(p.numel() for p in distinct),
        trainable_count=sum(p.numel() for p in distinct if p.requires_grad),
        largest_layer_params=largest,
    )


def stage3_persistent_params(module: torch.nn.Module, threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank instead of partitioning.

    Mirrors ``mark_persistent_parameters`` in deepspeed/runtime/zero/parameter_offload.py: a
    parameter with at most ``stage3_param_persistence_threshold`` elements is never released
    after use, because gathering it would cost more latency than its memory is worth. For small
    models that is every parameter, which makes stage 3 hold the full model like stage 0.
    """
    distinct = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() for p in distinct if p.numel() <= threshold)


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states of one rank, on device and on host."""

    params: int
    """Parameters on the device (the full model, or the rank's partition under stage 3)."""
    grads: int
    """Gradients kept on the device."""
    optimizer_states: int
    """fp32 master weights and optimizer moments kept on the device."""
    host_params: int = 0
    """Parameter bytes this rank keeps in host memory (offloaded partitions, staging copies)."""
    host_grads: int = 0
    """Gradient bytes this rank keeps in host memory when the optimizer is offloaded."""
    host_optimizer_states: int = 0
    """Master weights and moments this rank keeps in host memory when the optimizer is offloaded."""

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_total(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer_states


def _optimizer_moment_bytes(optimizer: OptimizerName, momentum: float) -> int:
    """fp32 bytes of optimizer state per trainable parameter, the master copy excluded."""
    if optimizer in (OptimizerName.adam, OptimizerName.adamw):
        return 2 * _FP32  # exp_avg and exp_avg_sq
    return _FP32 if momentum > 0 else 0  # SGD keeps a momentum buffer only when it uses one


def _master_copy_bytes(precision: Precision, zero_stage: int, optimizer_offloaded: bool) -> int:
    """fp32 bytes per trainable parameter of the optimizer's own copy of the weights.

    Mixed precision always keeps an fp32 master. In fp32 the answer depends on the stage:
    stage 0 steps the model's own parameters; stages 1-2 ``clone()`` the rank's partition into
    ``single_partition_of_fp32_groups`` even when it is already fp32 (stage_1_and_2.py); stage 3
    reuses the fp32 partition when it stays on the device and copies it only when the optimizer
    is offloaded (``_create_fp32_partitions`` in stage3.py).
    """
    if precision != Precision.fp32:
        return _FP32
    if zero_stage in (1, 2):
        return _FP32
    if zero_stage == 3 and optimizer_offloaded:
        return _FP32
    return 0


def model_state_bytes(*, param_count: int, trainable_count: int, zero_stage: int, dp: int, precision: Precision,
                      optimizer: OptimizerName, momentum: float, offload_optimizer: Offload,
                      offload_param: Offload) -> ModelStateBytes:
    """Bytes of model states on one rank's device and in host memory, as DeepSpeed lays them out.

    For mixed-precision Adam this is the ZeRO paper's per-device model state (Rajbhandari et al.
    2020, Fig. 1): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N for stages 0-3. Partitioned sizes are
    rounded up (``-(-x // N)``) because DeepSpeed pads each group to a multiple of N.
    """
    b = bytes_per_element(precision)
    n = max(dp, 1)
    offloaded = zero_stage >= 1 and offload_optimizer != Offload.none
    param_offloaded = zero_stage == 3 and offload_param != Offload.none
    per_trainable = _master_copy_bytes(precision, zero_stage, offloaded) + _optimizer_moment_bytes(optimizer, momentum)

    def part(x: int) -> int:
        return -(-x // n)

    # Parameters: whole on every rank below stage 3; stage 3 keeps only the rank's partition.
    if zero_stage == 3:
        params = part(b * param_count)
        host_params = params if param_offloaded else 0
        params = 0 if param_offloaded else params
    else:
        params, host_params = b * param_count, 0

    if zero_stage == 0:
        return ModelStateBytes(params=params, grads=b * trainable_count,
                               optimizer_states=per_trainable * trainable_count)

    optimizer_states = part(per_trainable * trainable_count)
    if zero_stage == 3:
        # grad_partitions_flat_buffer: the rank's partition of low-precision gradients.
        grads = part(b * trainable_count)
    elif zero_stage == 2:
        grads = part(b * trainable_count)
    else:
        # Stage 1 lets autograd produce every gradient whole and reduces them only at the
        # accumulation boundary, so the full gradient lives on the device until then.
        grads = b * trainable_count

    if not offloaded:
        return ModelStateBytes(params=params, grads=grads, optimizer_states=optimizer_states,
                               host_params=host_params)

    # ZeRO-Offload, read from DeepSpeed's source:
    # * Stages 1-2 (stage_1_and_2.py): the fp32 master partition and the moments are created on
    #   ``self.device = 'cpu'``; ``initialize_optimizer_states`` gives the master an fp32 ``.grad``
    #   on the host that, unlike without offload, is never freed; and a low-precision staging copy
    #   of the partition (``param_buffer_of_bit16_for_cpu_offload_groups``) lives on the host to
    #   carry updated weights back. On the device stay the full low-precision parameters, the
    #   reduction bucket and a ``temp_grad_buffer_for_gpu_offload`` of the largest parameter
    #   (both counted by :func:`zero_buffer_bytes`). Under stage 2 each gradient is reduced
    #   through the bucket and copied straight into the host fp32 gradient
    #   (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``); the device partition
    #   ``grads_in_partition`` is never allocated, so no gradient stays on the device. Stage 1
    #   still holds the whole gradient on the device until the boundary reduction.
    # * Stage 3 (stage3.py): ``self.device`` is cpu, so ``grad_partitions_flat_buffer`` (the
    #   low-precision gradient partition) is on the host, and each sub-group's master gets an
    #   fp32 gradient buffer on the host as well (``initialize_optimizer_states``).
    if zero_stage == 3:
        host_grads = part(b * trainable_count) + part(_FP32 * trainable_count)
        device_grads = 0
    else:
        host_grads = part(_FP32 * trainable_count)
        host_params += part(b * trainable_count)
        device_grads = grads if zero_stage == 1 else 0
    return ModelStateBytes(params=params, grads=device_grads, optimizer_states=0, host_params=host_params,
                           host_grads=host_grads, host_optimizer_states=optimizer_states)


def _zero_section(ds_config: dict) -> dict:
    return ds_config.get("zero_optimization", {}) or {}


def _offloaded(section: dict, key: str) -> bool:
    return (section.get(key) or {}).get("device", "none") != "none"


def zero_buffer_bytes(ds_config: dict, *, param_count: int, largest_layer_params: int, dp: int,
                      precision: Precision, accelerator: Accelerator = Accelerator.cpu,
                      persistent_params: int = 0) -> int:
    """Bytes of DeepSpeed's communication buffers and optimizer-step temporaries on one device.

    Read from the generated DeepSpeed config (``launchers/ds_config.py``); bucket sizes there are
    in elements. ``persistent_params`` is :func:`stage3_persistent_params` of the model (0 for a
    hypothetical model whose parameter shapes are unknown). The sum is conservative: the
    optimizer-step temporary never coexists with activations, but is added to them anyway.

    Sources (deepspeed/runtime/...):
    * ``zero/stage_1_and_2.py`` ``setup_buckets``: with ``contiguous_gradients`` (forced on by
      optimizer offload) each backward allocates a reduction bucket of ``reduce_bucket_size``
      elements in the gradient dtype, two with ``overlap_comm``. It is ``torch.empty`` of the full
      size whatever the model: a GPU's caching allocator reserves all of it, while on CPU only
      the pages written (at most the model's gradient) become resident, hence the min with Ψ.
    * ``utils.py`` ``all_gather_dp_groups``: stage 1-2 gathers updated weights in place into the
      flat parameter buffer, so ``allgather_bucket_size`` allocates nothing.
    * ``stage_1_and_2.py`` ``step``: without offload the rank's gradient partition is flattened
      and cast into an fp32 ``.grad`` of the master (4Φ/N) for the optimizer step.
    * ``zero/stage3.py``: a reduction bucket of ``reduce_bucket_size`` (allocated eagerly in
      ``__init__``); ``_prepare_fp32_grad_for_sub_group`` casts one sub-group (at most
      ``sub_group_size`` elements) of gradients to fp32 at a time for the step.
    * ``zero/partitioned_param_coordinator.py``: while a module runs, its parameters are gathered
      whole and up to ``stage3_prefetch_bucket_size`` more elements are prefetched, never beyond
      ``stage3_max_live_parameters``; the gathered module's full gradient exists until it is
      reduce-scattered (DeepSpeed's own estimator budgets 4 bytes per largest-layer parameter for
      this pair). Parameters under ``stage3_param_persistence_threshold`` stay gathered always.
    * ``engine.py`` ``allreduce_gradients``: stage 0 flattens gradients into buckets of
      MEMORY_OPT_ALLREDUCE_SIZE elements to all-reduce them.
    """
    zero = _zero_section(ds_config)
    stage = int(zero.get("stage", 0))
    b = bytes_per_element(precision)
    n = max(dp, 1)

    def resident(elements: int) -> int:
        return elements if accelerator == Accelerator.gpu else min(elements, param_count)

    if stage == 0:
        bucket = b * min(_STAGE0_ALLREDUCE_BUCKET, param_count) if n > 1 else 0
        # Mixed precision at stage 0 runs DeepSpeed's FP16_Optimizer, which casts the whole
        # gradient to an fp32 ``.grad`` of its flat master for the step.
        step = _FP32 * param_count if precision != Precision.fp32 else 0
        return bucket + step

    optimizer_offloaded = _offloaded(zero, "offload_optimizer")
    contiguous = bool(zero.get("contiguous_gradients", True)) or optimizer_offloaded
    reduce_bucket = int(zero.get("reduce_bucket_size", 500_000_000))
    buckets = 2 if zero.get("overlap_comm", False) and stage < 3 else 1
    total = b * resident(reduce_bucket) * buckets if contiguous else 0

    if stage in (1, 2):
        if optimizer_offloaded:
            # temp_grad_buffer_for_gpu_offload: one parameter's gradient staged for the copy.
            total += b * largest_layer_params
        else:
            total += _FP32 * -(-param_count // n)
        return total

    prefetch = int(zero.get("stage3_prefetch_bucket_size", 50_000_000))
    max_live = int(zero.get("stage3_max_live_parameters", 1_000_000_000))
    gathered = min(largest_layer_params + prefetch, max(max_live, largest_layer_params), param_count)
    total += b * gathered  # gathered parameters
    total += b * largest_layer_params  # the gathered module's gradient before reduce-scatter
    total += b * persistent_params
    if not optimizer_offloaded:
        sub_group = int(zero.get("sub_group_size", _STAGE3_SUB_GROUP_SIZE))
        total += _FP32 * min(sub_group, -(-param_count // n))
    return total


def reserve_bytes(subtotal: int, accelerator: Accelerator) -> int:
    """Allocator headroom on top of the live bytes (see :data:`FRAGMENTATION_RESERVE`)."""
    return int(subtotal * FRAGMENTATION_RESERVE) if accelerator == Accelerator.gpu else 0


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Predicted peak bytes of one device, by kind, against the device's capacity."""

    params: int
    grads: int
    optimizer_states: int
    activations: int
    """Saved activations of one micro-batch (plus one block's recompute under checkpointing)."""
    buffers: int
    """ZeRO communication buckets, gathered ZeRO-3 layers and optimizer-step temporaries."""
    reserve: int
    """Allocator fragmentation headroom."""
    total: int
    capacity: int
    """Bytes the device (on CPU: the worker's share of host memory) offers."""

    @property
    def headroom(self) -> int:
        """Bytes left after the predicted peak; negative when the plan does not fit."""
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, int | bool]:
        """Plain values, for tracking and JSON output."""
        return {**asdict(self), "headroom": self.headroom, "fits": self.fits}


def memory_breakdown(*, states: ModelStateBytes, activations: int, buffers: int, capacity: int,
                     accelerator: Accelerator) -> MemoryBreakdown:
    """Add the device-side parts up, with the allocator reserve on the sum."""
    subtotal = states.device_total + activations + buffers
    reserve = reserve_bytes(subtotal, accelerator)
    return MemoryBreakdown(params=states.params, grads=states.grads, optimizer_states=states.optimizer_states,
                           activations=activations, buffers=buffers, reserve=reserve, total=subtotal + reserve,
                           capacity=capacity)
