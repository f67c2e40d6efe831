"""The driver's side of the GPU mapping: gather every actor's GPUs, hand each rank its mapping.

Runs once the actors exist and before ``setup``: the mapping must reach each worker before it
initialises CUDA or joins the process group.
"""

from __future__ import annotations

from dataclasses import replace

import ray

from orch.launchers.devices import map_devices
from orch.launchers.placement import RankSlot


def share_gpus(actors: list, slots: list[RankSlot]) -> list[RankSlot]:
    """Send each actor (in rank order) its :class:`~orch.launchers.devices.DeviceMapping`.

    Returns the slots with ``local_rank`` set to the index of the rank's own GPU in its node's
    shared list, which is what ``LOCAL_RANK`` must say for DeepSpeed's device selection.
    """
    reported = ray.get([actor.accelerator_ids.remote() for actor in actors])
    mappings = map_devices(reported)
    ray.get([actor.use_devices.remote(mapping) for actor, mapping in zip(actors, mappings, strict=True)])
    return [replace(slot, local_rank=mapping.local_rank, local_world_size=mapping.local_world_size)
            for slot, mapping in zip(slots, mappings, strict=True)]
