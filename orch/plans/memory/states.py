"""How many bytes one rank needs: model states, ZeRO buffers and an allocator reserve.

Two views of the same bytes. :func:`model_state_bytes` is the ZeRO paper's accounting of
parameters, gradients and optimizer states. :func:`step_phases` follows one training step: what
persists between steps, and what each phase (forward, backward, end-of-backward reduction,
optimizer step) adds while it runs; the predicted peak is what persists plus the worst phase,
because most transients never coexist.

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

from orch.plans.engine_settings import EngineSettings
from orch.plans.memory.activations import ActivationBytes
from orch.plans.spec import Accelerator, Offload, OptimizerName, Precision

# Why 10%: PyTorch's CUDA caching allocator rounds every block up (512 B small blocks, 2 MiB
# segments for large ones) and cannot hand a free block in one segment to a request that only
# fits across two, so the memory it reserves exceeds the bytes of live tensors. ZeRO's flat
# buffers are few and large, which keeps this waste small; 10% is a reserve measured usage
# rarely exceeds without ``expandable_segments``. On CPU there is no caching allocator: large
# tensors are mmap'ed and returned to the OS on free, so no reserve is added there.
FRAGMENTATION_RESERVE = 0.10

# DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE (its runtime/engine.py), the bucket of the stage-0
# all-reduce: a constant of the engine, not a setting (the settings are orch.plans.engine_settings's).
_STAGE0_ALLREDUCE_BUCKET = 500_000_000

# The fp32 master weights and gradients the optimizer works on.
_FP32 = 4


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """Parameter counts of a built model, all the memory model needs to know about it."""

    param_count: int
    """Distinct parameters; a tied weight (embedding = lm_head) is counted once."""
    trainable_count: int
    """Parameters with ``requires_grad``: only these have gradients and optimizer states."""
    largest_layer_params: int
    """Most parameters owned directly by one module; ZeRO-3 gathers one such module whole."""
    largest_param: int = 0
    """Elements of the largest parameter tensor: DeepSpeed's offload staging buffers and torch
    Adam's per-tensor temporaries are this size."""
    built_bytes: int = 0
    """Bytes of the parameters and buffers in the dtypes the model's constructor creates them in:
    what building the model whole takes in host memory (:mod:`orch.plans.memory.build`)."""


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
        largest_param=max((p.numel() for p in distinct), default=0),
        built_bytes=sum(p.numel() * p.element_size() for p in distinct)
        + sum(b.numel() * b.element_size() for b in module.buffers()),
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

    Mixed precision always keeps an fp32 master. In fp32 stage 0 steps the model's own
    parameters; stages 1-2 ``clone()`` the rank's partition into ``single_partition_of_fp32_groups``
    even when it is already fp32 (stage_1_and_2.py). Stage 3 means to reuse it
    (``_create_fp32_partitions``, stage3.py line 1167 appends ``fp16_partitioned_groups_flat[i]``),
    but that flat tensor is not the storage the parameters' ``ds_tensor`` partitions live in:
    a real fp32 stage-3 worker holds both as separate 4Φ/N storages (measured, and identified by
    matching storages to ``fp16_partitioned_groups`` and ``fp32_partitioned_groups_flat``).
    """
    del optimizer_offloaded  # every offloaded master is a copy too; kept for the call sites' clarity
    if precision != Precision.fp32:
        return _FP32
    return _FP32 if zero_stage >= 1 else 0


def model_state_bytes(*, param_count: int, trainable_count: int, zero_stage: int, dp: int, precision: Precision,
                      optimizer: OptimizerName, momentum: float, offload_optimizer: Offload,
                      offload_param: Offload) -> ModelStateBytes:
    """Bytes of model states on one rank's device and in host memory, as DeepSpeed lays them out.

    For mixed-precision Adam this is the ZeRO paper's per-device model state (Rajbhandari et al.
    2020, Fig. 1): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N for stages 0-3. Partitioned sizes are
    rounded up (``-(-x // N)``) because DeepSpeed pads each group to a multiple of N.
    """
    b = precision.element_bytes
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


@dataclass(frozen=True, kw_only=True)
class PhaseBytes:
    """Bytes of one device by kind: what persists across steps, or what one phase adds to it."""

    phase: str
    """``held`` (between steps), ``forward``, ``backward``, ``reduction`` or ``optimizer step``."""
    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.activations + self.buffers


@dataclass(frozen=True, kw_only=True)
class DevicePhases:
    """One device through a training step: what it holds, and what each phase adds at its worst."""

    held: PhaseBytes
    """Alive from one step to the next: parameters, optimizer states, persistent ZeRO buffers."""
    phases: list[PhaseBytes]
    """Transients of each phase, on top of ``held``."""
    host_buffers: int = 0
    """Persistent staging buffers DeepSpeed keeps in host memory (outside ModelStateBytes)."""

    @property
    def binding(self) -> PhaseBytes:
        """The phase whose transients are largest: the step's peak is ``held`` plus these."""
        return max(self.phases, key=lambda p: p.total)


def step_phases(engine: EngineSettings, *, states: ModelStateBytes, model: ModelStats, activations: ActivationBytes,
                dp: int, precision: Precision, grad_accum_steps: int = 1,
                accelerator: Accelerator = Accelerator.cpu, persistent_params: int = 0) -> DevicePhases:
    """What one device holds between steps and what each phase of a step adds, as DeepSpeed 0.19 runs.

    The peak is ``held`` plus the largest phase, not the sum of everything: the all-reduce bucket
    of stage 0 is flattened after autograd has freed the activations, the optimizer step's fp32
    temporaries never meet them either, and ZeRO-1/2 gradients leave ``.grad`` for the reduction
    bucket as autograd produces them. Every number below was checked against a real 2-worker run
    traced per phase (bench/memory_accuracy.py); ``persistent_params`` is
    :func:`stage3_persistent_params` of the model. Sources, deepspeed/runtime/...:

    * held, stage 0: the parameters and torch Adam's moments; gradients are freed by
      ``zero_grad`` after each step.
    * held, stages 1-2: the parameters and the partitioned master and moments; no gradient
      survives the step (``grads_in_partition`` and the bucket are rebuilt every backward). With
      offload, ``temp_grad_buffer_for_gpu_offload`` on the device and
      ``temp_grad_buffer_for_cpu_offload`` on the host, one largest parameter each
      (``zero/stage_1_and_2.py`` lines 653-661), persist.
    * held, stage 3: the parameter and gradient partitions (``grad_partitions_flat_buffer``), the
      master and moments, the parameters under the persistence threshold kept whole, and the
      reduction bucket, allocated once in ``__init__`` (``zero/stage3.py`` line 782).
    * forward: the activations as they accumulate (``forward_peak``); stage 3 also holds every
      gathered parameter twice, the all-gather's flat output (``partition_parameters.py`` line
      1343, kept alive by its handle's ``partitions``) and the ``torch.cat`` copy that becomes
      ``param.data`` (line 795); within ``stage3_max_reuse_distance`` nothing is released
      before backward, so that is all non-persistent parameters up to ``stage3_max_live_parameters``.
    * backward: the activations' backward peak; at stages 0-1 autograd accumulates ``.grad``
      until the end of backward (``backward_peak_with_grads``), at stages 2-3 each gradient moves
      to the bucket as it appears (``backward_peak``). Stages 1-2 allocate the bucket of
      ``reduce_bucket_size`` (``setup_buckets``, line 3266); stage 3 keeps the gathered
      parameters once (the all-gather buffers are gone).
    * reduction, after autograd, activations freed: stage 0 all-reduces the full gradients
      through a flat bucket of MEMORY_OPT_ALLREDUCE_SIZE elements (``engine.py``); stages 1-2
      keep the bucket and the rank's gradient partition.
    * optimizer step: stage 0 keeps the full gradients (mixed precision adds the fp32 copy its
      FP16/BF16 optimizer steps on); stages 1-2 flatten the partition (a copy, while the partition
      is still referenced) and cast the copy to an fp32 ``.grad`` of the master (``step``, line
      3118): 2bΦ/N + 4Φ/N at the cast, 8Φ/N in bf16 as in fp32; stage 3 flattens one sub-group
      (``_prepare_fp32_grad_for_sub_group``); torch Adam then adds two temporaries of the tensor
      it steps (``engine.torch_adam``: its single-tensor path on CPU makes ``exp_avg_sq.sqrt()``
      and the bias-corrected division).
    * ``grad_accum_steps > 1``: the gradients of earlier micro-batches coexist with the next
      micro-batch's forward and backward (full at stages 0-1, the partition at stage 2).
    """
    stage = engine.zero_stage
    b = precision.element_bytes
    n = max(dp, 1)
    psi, phi = model.param_count, model.trainable_count
    largest_param = model.largest_param or model.largest_layer_params
    offloaded = engine.optimizer_offloaded
    adam_temporaries = 2 if engine.torch_adam else 0
    accumulating = grad_accum_steps > 1

    def part(x: int) -> int:
        return -(-x // n)

    def resident(elements: int) -> int:
        # torch.empty of the bucket: a GPU's caching allocator reserves all of it; on CPU the
        # bucket is capped at the model by ds_config.py and only pages written become resident.
        return elements if accelerator == Accelerator.gpu else min(elements, psi)

    contiguous = engine.contiguous_gradients or offloaded
    reduce_bucket = b * resident(engine.reduce_bucket_size) if contiguous else 0

    if stage == 0:
        held = PhaseBytes(phase="held", params=states.params, optimizer_states=states.optimizer_states)
        full_grads = b * phi
        during_backward = activations.backward_peak if accumulating else \
            activations.backward_peak_with_grads - activations.grads_at_backward_peak
        grads_in_backward = full_grads if accumulating else activations.grads_at_backward_peak
        mixed_fp32_grads = _FP32 * phi if precision != Precision.fp32 else 0
        phases = [
            PhaseBytes(phase="forward", activations=activations.forward_peak,
                       grads=full_grads if accumulating else 0),
            PhaseBytes(phase="backward", activations=during_backward, grads=grads_in_backward),
            PhaseBytes(phase="reduction", grads=full_grads,
                       buffers=b * min(_STAGE0_ALLREDUCE_BUCKET, psi) if n > 1 else 0),
            PhaseBytes(phase="optimizer step", grads=full_grads,
                       buffers=mixed_fp32_grads + adam_temporaries * _FP32 * largest_param),
        ]
        return DevicePhases(held=held, phases=phases)

    if stage in (1, 2):
        staging = b * largest_param if offloaded else 0
        held = PhaseBytes(phase="held", params=states.params, optimizer_states=states.optimizer_states,
                          buffers=staging)
        buckets = reduce_bucket * (2 if engine.overlap_comm else 1)
        partition = 0 if offloaded else part(b * phi)
        if stage == 1:
            earlier = b * phi if accumulating else 0
            during_backward = activations.backward_peak if accumulating else \
                activations.backward_peak_with_grads - activations.grads_at_backward_peak
            grads_in_backward = earlier or activations.grads_at_backward_peak
        else:
            earlier = partition if accumulating else 0
            during_backward, grads_in_backward = activations.backward_peak, earlier
        phases = [
            PhaseBytes(phase="forward", activations=activations.forward_peak, grads=earlier),
            PhaseBytes(phase="backward", activations=during_backward, grads=grads_in_backward, buffers=buckets),
            PhaseBytes(phase="reduction", grads=partition, buffers=buckets),
        ]
        if not offloaded:
            fp32_partition = _FP32 * part(phi)
            # step() first flattens the rank's gradient partition (``self.flatten``, a torch.cat
            # copy) while the partition itself is still referenced, then casts the copy to fp32
            # (``.to``: a third tensor unless it is fp32 already); the optimizer then steps on the
            # fp32 gradient alone, with torch Adam's temporaries.
            cast = PhaseBytes(phase="optimizer step", grads=partition,
                              buffers=partition + (fp32_partition if b != _FP32 else 0))
            stepping = PhaseBytes(phase="optimizer step", buffers=fp32_partition * (1 + adam_temporaries))
            phases.append(max(cast, stepping, key=lambda p: p.total))
        return DevicePhases(held=held, phases=phases, host_buffers=staging)

    held = PhaseBytes(phase="held", params=states.params + b * persistent_params, grads=states.grads,
                      optimizer_states=states.optimizer_states, buffers=reduce_bucket)
    max_live = engine.stage3_max_live_parameters
    gathered = b * min(max(psi - persistent_params, 0), max(max_live, model.largest_layer_params))
    phases = [
        PhaseBytes(phase="forward", activations=activations.forward_peak, buffers=2 * gathered),
        PhaseBytes(phase="backward", activations=activations.backward_peak, buffers=gathered),
    ]
    if not offloaded:
        sub_group = _FP32 * min(engine.sub_group_size, part(phi))
        phases.append(PhaseBytes(phase="optimizer step", buffers=sub_group * (1 + adam_temporaries)))
    return DevicePhases(held=held, phases=phases)


def reserve_bytes(subtotal: int, accelerator: Accelerator) -> int:
    """Allocator headroom on top of the live bytes (see :data:`FRAGMENTATION_RESERVE`)."""
    return int(subtotal * FRAGMENTATION_RESERVE) if accelerator == Accelerator.gpu else 0


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Predicted peak bytes of one device, by kind, at the phase of the step where it peaks.

    Each component is what is alive at that moment (``held`` plus the binding phase's
    transients), so ``params + grads + optimizer_states + activations + buffers + reserve`` is
    ``total``.
    """

    params: int
    grads: int
    optimizer_states: int
    activations: int
    """Activation bytes alive at the peak (saved tensors, activation gradients, a recomputed layer)."""
    buffers: int
    """ZeRO buckets, gathered ZeRO-3 parameters and optimizer-step temporaries alive at the peak."""
    reserve: int
    """Allocator fragmentation headroom."""
    total: int
    capacity: int
    """Bytes the device (on CPU: the worker's share of host memory) offers."""
    held: int = 0
    """Bytes held between steps (parameters, optimizer states, persistent buffers)."""
    phase: str = "held"
    """The phase of the step where the peak is: forward, backward, reduction or optimizer step."""

    @property
    def headroom(self) -> int:
        """Bytes left after the predicted peak; negative when the plan does not fit."""
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, int | bool | str]:
        """Plain values, for tracking and JSON output."""
        return {**asdict(self), "headroom": self.headroom, "fits": self.fits}


def memory_breakdown(*, device: DevicePhases, capacity: int, accelerator: Accelerator) -> MemoryBreakdown:
    """The peak: what is held plus the binding phase's transients, with the allocator reserve on it."""
    held, peak = device.held, device.binding
    subtotal = held.total + peak.total
    reserve = reserve_bytes(subtotal, accelerator)
    return MemoryBreakdown(params=held.params + peak.params, grads=held.grads + peak.grads,
                           optimizer_states=held.optimizer_states + peak.optimizer_states,
                           activations=held.activations + peak.activations, buffers=held.buffers + peak.buffers,
                           reserve=reserve, total=subtotal + reserve, capacity=capacity, held=held.total,
                           phase=peak.phase)
