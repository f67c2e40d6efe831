"""Rank order on the cluster: a pure function of where the actors landed."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from orch.plans.parallel.rank_layout import parallel_coords


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


def rank_layout(world_size: int, devices_per_node: int, tp: int, pp: int = 1, cp: int = 1) -> list[dict[str, int]]:
    """Where every rank of a plan runs, as launched: node, local rank, dp, pp, cp and tp coordinates
    (cp only where the plan splits the sequence).

    Nodes fill in order (:func:`assign_ranks` keeps a node's ranks contiguous) and tp is the
    innermost dimension, so tensor-parallel groups share a node and dp replicas span nodes.
    """
    layout = []
    for r in range(world_size):
        coords = asdict(parallel_coords(r, world_size, tp, pp, cp))
        if cp == 1:
            del coords["cp_rank"]
        layout.append({"rank": r, "node": r // devices_per_node, "local_rank": r % devices_per_node, **coords})
    return layout


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
