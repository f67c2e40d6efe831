"""Rank order on the cluster: a pure function of where the actors landed."""

from __future__ import annotations

from dataclasses import dataclass


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
