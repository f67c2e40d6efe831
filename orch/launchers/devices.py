"""Which GPU each rank uses: the node's workers share one ``CUDA_VISIBLE_DEVICES``.

Ray makes only an actor's own GPU visible to it, so every rank sees a single device 0 and
DeepSpeed's ``set_device(LOCAL_RANK)`` fails on every rank of a node but the first; NCCL also
needs to see the peers' devices to use peer-to-peer links. Ray Train solves this by giving
all workers of a node the sorted union of their GPU ids; a rank's ``LOCAL_RANK`` is then the
position of its *own* GPU in that list (not its position among the node's actors), which is
the index it passes to ``torch.cuda.set_device``. This module is the pure part of that: it
takes what each actor reports and returns each rank's mapping; it imports neither Ray nor torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from orch.plans.errors import OrchError


class DeviceMappingError(OrchError):
    """The GPUs Ray assigned to the workers cannot be mapped one device per rank."""


@dataclass(frozen=True, kw_only=True)
class DeviceMapping:
    """The devices one rank sees and the one it uses."""

    cuda_visible_devices: str
    """The node's shared list: the sorted union of the GPU ids of that node's workers."""
    local_rank: int
    """Index of this rank's own GPU in ``cuda_visible_devices``."""
    local_world_size: int
    """How many workers (and GPUs) the run has on this node."""

    @property
    def device_index(self) -> int:
        """The index for ``torch.cuda.set_device``: devices are numbered within the visible list."""
        return self.local_rank

    def env(self) -> dict[str, str]:
        """The worker environment this mapping sets (before DeepSpeed reads it)."""
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "LOCAL_SIZE": str(self.local_world_size)}


def _gpu_order(gpu_id: str) -> tuple[int, int, str]:
    """Numeric ids in numeric order ("2" before "10"); any other id (a UUID) after them, by text."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def map_devices(workers: Sequence[tuple[str, Sequence[str | int]]]) -> list[DeviceMapping]:
    """Per rank, given each rank's ``(node_id, gpu_ids)`` as its actor reported them.

    Every worker must hold exactly one GPU (the orchestrator runs one rank per device), and no
    GPU id may appear twice on one node; anything else raises :class:`DeviceMappingError`.
    """
    problems: list[str] = []
    by_node: dict[str, list[str]] = defaultdict(list)
    for rank, (node_id, gpu_ids) in enumerate(workers):
        ids = [str(gpu_id) for gpu_id in gpu_ids]
        if len(ids) != 1:
            problems.append(f"rank {rank} on node {node_id} holds {len(ids)} GPUs {ids}, expected exactly 1")
            continue
        by_node[node_id].append(ids[0])
    for node_id, ids in by_node.items():
        duplicates = sorted({i for i in ids if ids.count(i) > 1}, key=_gpu_order)
        if duplicates:
            problems.append(f"node {node_id} gave GPU id(s) {duplicates} to more than one worker")
    if problems:
        raise DeviceMappingError(
            "cannot give each rank its own GPU: " + "; ".join(problems) + ". Fix: request one whole GPU per "
            "worker (cluster.accelerator=gpu gives each actor num_gpus=1) and do not start other GPU "
            "actors with fractional num_gpus on the run's nodes")
    shared = {node_id: sorted(ids, key=_gpu_order) for node_id, ids in by_node.items()}
    mappings = []
    for node_id, gpu_ids in workers:
        visible = shared[node_id]
        mappings.append(DeviceMapping(cuda_visible_devices=",".join(visible),
                                      local_rank=visible.index(str(gpu_ids[0])),
                                      local_world_size=len(visible)))
    return mappings
