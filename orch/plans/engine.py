"""The engine settings a plan implies, as one typed object.

The memory model, the estimate, the cost model and the DeepSpeed config all start from
:class:`EngineSettings`: ``orch/launchers/engines/deepspeed/config.py`` only serializes it to DeepSpeed's JSON, so the
planner reasons about exactly the buckets, thresholds and offload targets the workers will run
with. Every limit is written out (at DeepSpeed's defaults where the plan does not decide it)
instead of being left to DeepSpeed's implicit values.

An FSDP2 plan (``plan.engine=fsdp2``) maps onto the same object as what it shards: parameters,
gradients and optimizer states, like ZeRO stage 3, so the cost model prices its all-gathers and
reduce-scatters as ZeRO-3's; its own settings (``reshard_after_forward``, ``hybrid``) ride along,
and :func:`fsdp_mesh` says which ranks share one parameter's shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from orch.plans.optim_settings import OptimSettings
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, EngineName, Offload, OptimizerName, OptimSpec, Precision

# DeepSpeed's defaults (its runtime/zero/config.py), in elements.
REDUCE_BUCKET_SIZE = 500_000_000
ALLGATHER_BUCKET_SIZE = 500_000_000
STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
STAGE3_MAX_REUSE_DISTANCE = 1_000_000_000
SUB_GROUP_SIZE = 1_000_000_000

BUCKET_ALIGNMENT = 1024
"""Bucket sizes are multiples of this many elements (a multiple of every alignment DeepSpeed asks)."""


class ZeroStage(IntEnum):
    """What ZeRO partitions over the data-parallel ranks, cumulatively."""

    none = 0
    optimizer_states = 1
    gradients = 2
    parameters = 3


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The sharding and optimizer settings of one plan (before they become DeepSpeed JSON)."""

    zero_stage: ZeroStage
    """What is sharded over the data-parallel ranks; ``parameters`` for every FSDP2 plan."""
    engine: EngineName = EngineName.deepspeed
    reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward (gather again for backward)."""
    hybrid: bool = False
    """FSDP2: shard within a node and replicate across nodes (:func:`fsdp_mesh`)."""
    reduce_bucket_size: int = REDUCE_BUCKET_SIZE
    """Elements of the gradient reduction bucket (stages 1-3)."""
    allgather_bucket_size: int = ALLGATHER_BUCKET_SIZE
    """Elements of the parameter all-gather bucket (stages 1-2)."""
    overlap_comm: bool = False
    """Overlap the gradient reduction with backward: a second reduce bucket."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    stage3_prefetch_bucket_size: int = STAGE3_PREFETCH_BUCKET_SIZE
    stage3_param_persistence_threshold: int = STAGE3_PARAM_PERSISTENCE_THRESHOLD
    """Stage 3 keeps parameters of at most this many elements whole on every rank."""
    stage3_max_live_parameters: int = STAGE3_MAX_LIVE_PARAMETERS
    """Stage 3 gathers at most this many parameters at once (beyond the largest layer)."""
    stage3_max_reuse_distance: int = STAGE3_MAX_REUSE_DISTANCE
    sub_group_size: int = SUB_GROUP_SIZE
    """Stage 3 steps the optimizer over sub-groups of this many elements."""
    offload_optimizer: Offload = Offload.none
    offload_param: Offload = Offload.none
    nvme_path: str | None = None
    pin_memory: bool = False
    """Pinned host buffers for offload (GPU workers: faster copies)."""
    torch_adam: bool = False
    """The step runs torch's Adam/AdamW (CPU workers without offload) instead of DeepSpeed's."""
    fused_adam: bool = False
    """torch's Adam runs its fused kernel, which steps every tensor in place: FSDP2 without fp16's
    loss scaler (``orch.launchers.engines.fsdp2.torch_optim.build_optimizer``)."""

    @property
    def optimizer_offloaded(self) -> bool:
        """Optimizer states live on the host (only ZeRO stages 1-3 offload them)."""
        return self.zero_stage >= ZeroStage.optimizer_states and self.offload_optimizer != Offload.none


def engine_settings(plan: ResolvedPlan, optim: OptimSpec | OptimSettings,
                    param_count: int | None = None) -> EngineSettings:
    """The engine settings of ``plan``; of ``optim`` (declared or resolved) only its ``name`` matters.

    With ``param_count`` the communication buckets are capped at the model's size: DeepSpeed
    allocates its reduce bucket at full size (500M elements = 2 GB in fp32) whatever the model,
    which a small model never fills. The cap is rounded up to a multiple of
    :data:`BUCKET_ALIGNMENT`: ZeRO-2 refuses a bucket that is not a multiple of its alignment
    factor (2 to 8 elements, by dtype and world size).
    """
    cap = -(-param_count // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT if param_count else REDUCE_BUCKET_SIZE
    gpu = plan.accelerator == Accelerator.gpu
    adam = optim.name in (OptimizerName.adam, OptimizerName.adamw)
    if plan.engine == EngineName.fsdp2:
        # FSDP2 has no buckets: it all-gathers and reduce-scatters one block's parameters at a time
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_all_gather and
        # foreach_reduce); its optimizer is torch's own, stepping the sharded fp32 parameters.
        return EngineSettings(
            zero_stage=ZeroStage.parameters, engine=EngineName.fsdp2,
            reshard_after_forward=plan.fsdp.reshard_after_forward, hybrid=plan.fsdp.hybrid,
            overlap_comm=gpu, offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param,
            pin_memory=gpu, torch_adam=adam,
            # A loss scaler's step hands the fused kernel a scale it cannot take from sharded
            # gradients, so fp16 steps with the multi-tensor kernel.
            fused_adam=adam and plan.precision != Precision.fp16)
    return EngineSettings(
        zero_stage=ZeroStage(plan.zero_stage),
        reduce_bucket_size=min(REDUCE_BUCKET_SIZE, cap),
        allgather_bucket_size=min(ALLGATHER_BUCKET_SIZE, cap),
        # On GPU the overlap hides NCCL time behind backward; on CPU (gloo) there is nothing to hide.
        overlap_comm=gpu,
        offload_optimizer=plan.offload_optimizer,
        offload_param=plan.offload_param,
        nvme_path=plan.nvme_path,
        pin_memory=gpu,
        # Without offload on CPU workers, torch's Adam avoids JIT-building DeepSpeed's FusedAdam,
        # which needs CUDA; with offload DeepSpeed picks its CPU Adam itself.
        torch_adam=adam and not gpu and plan.offload_optimizer == Offload.none,
    )


@dataclass(frozen=True, kw_only=True)
class FSDPMesh:
    """How FSDP2 lays the data-parallel ranks out: ``shard`` ranks split each parameter, and
    ``replicate`` groups of them hold the same shards (HSDP; 1 without ``plan.fsdp.hybrid``)."""

    shard: int
    replicate: int = 1


def fsdp_mesh(plan: ResolvedPlan, devices_per_node: int) -> FSDPMesh:
    """The data-parallel mesh of an FSDP2 plan. Hybrid sharding shards over the data-parallel
    ranks of one node (``devices_per_node / tp`` of them; a tensor-parallel group stays in a node)
    and replicates across nodes; otherwise every data-parallel rank holds one shard."""
    if not plan.fsdp.hybrid:
        return FSDPMesh(shard=plan.dp)
    per_node = max(devices_per_node // max(plan.tp * plan.pp, 1), 1)
    shard = min(plan.dp, per_node)
    return FSDPMesh(shard=shard, replicate=max(plan.dp // shard, 1))
