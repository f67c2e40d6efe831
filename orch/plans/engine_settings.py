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
from orch.plans.spec import Offload, OptimSpec

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
    module_hooks: bool = False
    """Parameters are fetched and released in hooks on every module (DeepSpeed's ZeRO-3), a cost
    per module call that the cost model adds (``zero3_hooks_s``)."""
    fused_adam: bool = False
    """torch's Adam runs its fused kernel, which steps every tensor in place: FSDP2 without fp16's
    loss scaler (``orch.launchers.engines.fsdp2.torch_optim.build_optimizer``)."""

    @property
    def optimizer_offloaded(self) -> bool:
        """Optimizer states live on the host (only ZeRO stages 1-3 offload them)."""
        return self.zero_stage >= ZeroStage.optimizer_states and self.offload_optimizer != Offload.none


def engine_settings(plan: ResolvedPlan, optim: OptimSpec | OptimSettings,
                    param_count: int | None = None) -> EngineSettings:
    """The engine settings of ``plan``, as its engine's spec sets them
    (:meth:`orch.plans.engines.base.EngineSpec.settings`); of ``optim`` (declared or resolved) only
    its ``name`` matters. With ``param_count`` an engine may size its buffers to the model."""
    from orch.plans.engines import engine_spec

    return engine_spec(plan.engine).settings(plan, optim, param_count)
