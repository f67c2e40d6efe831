"""Rank order on the cluster: a pure function of where the actors landed."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs."""

    rank: int
    node_id: str
    local_rank: int
    local_world_size: int


def assign_ranks(node_ids: list[str]) -> list[RankSlot]:
    """Give ranks to actors so that ranks on one node are contiguous.

    ``node_ids[i]`` is the node of actor ``i``; the result's entry ``i`` is that actor's slot.
    Nodes are ordered by the first actor that landed on them, so the node of actor 0 hosts rank 0.
    """
    order: dict[str, list[int]] = {}
    for actor, node in enumerate(node_ids):
        order.setdefault(node, []).append(actor)
    slots: list[RankSlot | None] = [None] * len(node_ids)
    rank = 0
    for node, actors in order.items():
        for local_rank, actor in enumerate(actors):
            slots[actor] = RankSlot(rank, node, local_rank, len(actors))
            rank += 1
    return slots  # type: ignore[return-value]


@dataclass(frozen=True)
class ParallelCoords:
    """Where one rank sits in the dp × pp × tp grid."""

    dp_rank: int
    """Which data-parallel replica (and data shard) the rank belongs to."""
    tp_rank: int
    """Which shard of the tensor-parallel layers the rank holds."""
    pp_rank: int = 0
    """Which pipeline stage (which slice of the layers) the rank runs."""


# The grid's axes from outermost to innermost, with DeepSpeed's names for them
# (deepspeed.runtime.pipe.topology.ProcessTopology): rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
GRID_AXES = ("data", "pipe", "model")


def parallel_coords(rank: int, world_size: int, tp: int, pp: int = 1) -> ParallelCoords:
    """The rank's coordinates, tp innermost, then pp, dp outermost: ``rank = (dp_rank * pp + pp_rank) * tp + tp_rank``.

    Tensor-parallel groups are blocks of ``tp`` consecutive ranks, so with :func:`assign_ranks`
    (a node's ranks are contiguous) and tp dividing the devices per node, a group never spans
    nodes: its all-reduces, two per layer in forward and two in backward, stay on the fastest
    links. Pipeline stages come next: they exchange one activation per micro-batch, point to
    point. Data-parallel replicas are outermost: they meet once per step, for the gradients, so
    they are the ones that cross nodes. DeepSpeed builds the same groups from a
    ``ProcessTopology`` with :data:`GRID_AXES` (pipelines) or a ``(data_parallel, tensor_parallel)``
    device mesh (``deepspeed.utils.groups._init_tp_mesh_device``, AutoTP without pipelines). All
    ranks of one tensor-parallel group must read the same batch, so the data shard is chosen by
    ``dp_rank``.
    """
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"tp({tp}) * pp({pp}) must be at least 1 and divide the world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    return ParallelCoords(dp_rank=rank // (tp * pp), tp_rank=rank % tp, pp_rank=rank // tp % pp)


def rank_layout(world_size: int, devices_per_node: int, tp: int, pp: int = 1) -> list[dict[str, int]]:
    """Where every rank of a plan runs, as launched: node, local rank, dp, pp and tp coordinates.

    Nodes fill in order (:func:`assign_ranks` keeps a node's ranks contiguous) and tp is the
    innermost dimension, so tensor-parallel groups share a node and dp replicas span nodes.
    """
    return [{"rank": r, "node": r // devices_per_node, "local_rank": r % devices_per_node,
             **asdict(parallel_coords(r, world_size, tp, pp))} for r in range(world_size)]


def placement_strategy(nodes: int) -> str:
    """The Ray placement-group strategy for a plan's one-bundle-per-device group.

    One node: ``STRICT_PACK``, every device there or none. Several nodes: ``PACK``, which fills
    a node before the next, so the contiguous ranks of a node (:func:`assign_ranks`) hold whole
    tensor-parallel groups; :func:`straddling_groups` checks what Ray actually granted.
    """
    return "STRICT_PACK" if nodes <= 1 else "PACK"


def straddling_groups(slots: list[RankSlot], tp: int) -> list[list[int]]:
    """Tensor-parallel groups (ranks) whose members landed on more than one node."""
    by_rank = sorted(slots, key=lambda s: s.rank)
    groups = [by_rank[i:i + tp] for i in range(0, len(by_rank), tp)]
    return [[s.rank for s in group] for group in groups if len({s.node_id for s in group}) > 1]
