"""The dp × pp × cp × tp rank grid: which coordinates a global rank has, and back (pure, no Ray).

One layout for the whole project: ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``
(cp = 1 unless the sequence is split: ``(dp_rank * pp + pp_rank) * tp + tp_rank``). The
launcher places ranks by it, the engines build their process groups from it, and the cost model
reads each group's spread over nodes off its stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GroupKind = Literal["tp", "cp", "pp", "dp"]


@dataclass(frozen=True)
class ParallelCoords:
    """Where one rank sits in the dp × pp × tp grid."""

    dp_rank: int
    """Which data-parallel replica (and data shard) the rank belongs to."""
    tp_rank: int
    """Which shard of the tensor-parallel layers the rank holds."""
    pp_rank: int = 0
    """Which pipeline stage (which slice of the layers) the rank runs."""
    cp_rank: int = 0
    """Which part of each sample's sequence the rank holds (context parallelism)."""


# The grid's axes from outermost to innermost, with DeepSpeed's names for them
# (deepspeed.runtime.pipe.topology.ProcessTopology): rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
GRID_AXES = ("data", "pipe", "model")


def parallel_coords(rank: int, world_size: int, tp: int, pp: int = 1, cp: int = 1) -> ParallelCoords:
    """The rank's coordinates, tp innermost, then cp, pp, dp outermost:
    ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``.

    Tensor-parallel groups are blocks of ``tp`` consecutive ranks, so with :func:`assign_ranks`
    (a node's ranks are contiguous) and tp dividing the devices per node, a group never spans
    nodes: its all-reduces, two per layer in forward and two in backward, stay on the fastest
    links. Context-parallel groups come next (blocks of ``cp * tp``): they gather keys and values in
    every layer, so they are the next to stay inside a node. Pipeline stages follow: they
    exchange one activation per micro-batch, point to
    point. Data-parallel replicas are outermost: they meet once per step, for the gradients, so
    they are the ones that cross nodes. DeepSpeed builds the same groups from a
    ``ProcessTopology`` with :data:`GRID_AXES` (pipelines) or a ``(data_parallel, tensor_parallel)``
    device mesh (``deepspeed.utils.groups._init_tp_mesh_device``, AutoTP without pipelines). All
    ranks of one tensor-parallel group must read the same batch, so the data shard is chosen by
    ``dp_rank``; so must all ranks of one context-parallel group, each keeping its part of the sequence.
    """
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        raise ValueError(f"tp({tp}) * pp({pp}) * cp({cp}) must be at least 1 and divide the world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    return ParallelCoords(dp_rank=rank // (tp * cp * pp), tp_rank=rank % tp, pp_rank=rank // (tp * cp) % pp,
                          cp_rank=rank // tp % cp)


def global_rank(dp_rank: int, pp_rank: int, tp_rank: int, *, tp: int, pp: int = 1, cp_rank: int = 0,
                cp: int = 1) -> int:
    """The rank at those coordinates: the inverse of :func:`parallel_coords`."""
    return ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank


def group_stride(kind: GroupKind, tp: int, pp: int = 1, cp: int = 1) -> int:
    """The rank distance between neighbouring members of one tp, cp, pp or dp group: a group's
    members are ``first, first + stride, first + 2 * stride, ...``."""
    strides = {"tp": 1, "cp": tp, "pp": tp * cp, "dp": tp * cp * pp}
    return strides[kind]
