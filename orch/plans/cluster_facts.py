"""Reconcile the declared cluster with the facts read off a live one (pure, no Ray)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orch.plans.errors import Violation
from orch.plans.spec import Accelerator, ClusterSpec

GIB = 1024**3


@dataclass(frozen=True)
class NodeFacts:
    """One alive node of the live cluster."""

    node_id: str
    address: str
    cpus: float
    gpus: float
    host_memory_bytes: int
    gpu_memory_bytes: int | None
    """Memory of one GPU of the node (None on CPU-only nodes)."""


def worker_slots(cluster: ClusterSpec, cpus: float, gpus: float) -> int:
    """The workers a node of ``cpus`` and ``gpus`` holds, as ``cluster`` sizes a worker (a GPU each, or
    ``cluster.cpus_per_worker`` CPUs each)."""
    return int(gpus) if cluster.accelerator == Accelerator.gpu else int(cpus // cluster.cpus_per_worker)


def reconcile(cluster: ClusterSpec, nodes: list[NodeFacts]) -> tuple[ClusterSpec, list[Violation], list[str]]:
    """The cluster to plan for: the declared shape with the live cluster's memory.

    Returns the adjusted spec, the violations (the live cluster cannot host the declared
    workers) and notes saying which declared numbers the facts replaced.
    """
    notes: list[str] = []
    violations: list[Violation] = []
    gpu = cluster.accelerator == Accelerator.gpu
    per_node = [worker_slots(cluster, n.cpus, n.gpus) for n in nodes]
    usable = sorted(((slots, n) for slots, n in zip(per_node, nodes, strict=True) if slots >= 1),
                    key=lambda pair: pair[0])
    kind = "GPU" if gpu else f"{cluster.cpus_per_worker:g}-CPU"
    if sum(slots for slots, _ in usable) < cluster.world_size:
        violations.append(Violation(
            "cluster.nodes", cluster.nodes,
            f"cluster.nodes({cluster.nodes}) * cluster.devices_per_node({cluster.devices_per_node}) = "
            f"{cluster.world_size} workers, but the live cluster has room for "
            f"{sum(slots for slots, _ in usable)} {kind} workers on {len(usable)} node(s).",
            "declare the cluster you have (cluster.nodes / cluster.devices_per_node) or add nodes"))
    if not usable:
        return cluster, violations, notes

    # The tightest of the nodes the plan would use decides what fits.
    chosen = [n for _, n in usable[-cluster.nodes:]]
    host = min(n.host_memory_bytes for n in chosen) / GIB
    changes: dict[str, float] = {}
    if abs(host - cluster.host_memory_gib) > 0.01:
        changes["host_memory_gib"] = round(host, 2)
        notes.append(f"cluster.host_memory_gib: declared {cluster.host_memory_gib:g}, "
                     f"the live cluster's nodes have {host:.2f}")
    if gpu:
        device = min(n.gpu_memory_bytes or 0 for n in chosen) / GIB
        if abs(device - cluster.device_memory_gib) > 0.01:
            changes["device_memory_gib"] = round(device, 2)
            notes.append(f"cluster.device_memory_gib: declared {cluster.device_memory_gib:g}, "
                         f"the live cluster's GPUs have {device:.2f}")
    else:
        share = host / cluster.devices_per_node
        if cluster.device_memory_gib > share:
            changes["device_memory_gib"] = round(share, 2)
            notes.append(f"cluster.device_memory_gib: declared {cluster.device_memory_gib:g}, but "
                         f"{cluster.devices_per_node} CPU workers share {host:.2f} GiB of host memory: "
                         f"{share:.2f} each")
    return dataclasses.replace(cluster, **changes), violations, notes
