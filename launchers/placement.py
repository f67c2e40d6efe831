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
    """Where one rank sits in the dp × tp grid."""

    dp_rank: int
    """Which data-parallel replica (and data shard) the rank belongs to."""
    tp_rank: int
    """Which shard of the tensor-parallel layers the rank holds."""


def parallel_coords(rank: int, world_size: int, tp: int) -> ParallelCoords:
    """The rank's data- and tensor-parallel coordinates, tp innermost: ``rank = dp_rank * tp + tp_rank``.

    Tensor-parallel groups are blocks of ``tp`` consecutive ranks, so with :func:`assign_ranks`
    (a node's ranks are contiguous) and tp dividing the devices per node, a group never spans
    nodes. DeepSpeed builds the same groups: a ``(data_parallel, tensor_parallel)`` device mesh
    (``deepspeed.utils.groups._init_tp_mesh_device``). All ranks of one group must read the same
    batch, so the data shard is chosen by ``dp_rank``.
    """
    if tp < 1 or world_size % tp:
        raise ValueError(f"tp({tp}) must be at least 1 and divide the world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    return ParallelCoords(dp_rank=rank // tp, tp_rank=rank % tp)


def rank_layout(world_size: int, devices_per_node: int, tp: int) -> list[dict[str, int]]:
    """Where every rank of a plan runs, as launched: node, local rank, dp and tp coordinates.

    Nodes fill in order (:func:`assign_ranks` keeps a node's ranks contiguous) and tp is the
    innermost dimension, so tensor-parallel groups share a node and dp replicas span nodes.
    """
    return [{"rank": r, "node": r // devices_per_node, "local_rank": r % devices_per_node,
             **asdict(parallel_coords(r, world_size, tp))} for r in range(world_size)]
