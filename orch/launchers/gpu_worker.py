"""The worker's side of the GPU mapping: report what Ray assigned, then use the mapped device.

Apart from :mod:`orch.launchers.devices` because these touch the process (Ray's runtime context,
``os.environ``, CUDA); the decisions stay pure there.
"""

from __future__ import annotations

import os

from orch.launchers.devices import DeviceMapping


def accelerator_ids() -> tuple[str, list[str]]:
    """This actor's node id and the GPU ids Ray assigned to it (empty on a CPU actor)."""
    import ray

    context = ray.get_runtime_context()
    return context.get_node_id(), list(context.get_accelerator_ids().get("GPU", []))


def use_device(mapping: DeviceMapping) -> None:
    """Make the node's shared GPUs visible and select this rank's own one.

    Must run before anything initialises CUDA in the process (CUDA reads
    ``CUDA_VISIBLE_DEVICES`` once) and before ``deepspeed.init_distributed``, whose NCCL
    communicator binds to the current device.
    """
    os.environ.update(mapping.env())
    import torch

    torch.cuda.set_device(mapping.device_index)


def cuda_memory_facts(device) -> dict[str, int]:
    """The measured peak and held bytes of this rank's GPU, from CUDA's caching allocator:
    the peak since :func:`reset_cuda_peak` and what is allocated now."""
    import torch

    return {"measured_peak_bytes": torch.cuda.max_memory_allocated(device),
            "measured_state_bytes": torch.cuda.memory_allocated(device)}


def reset_cuda_peak(device) -> None:
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def release_cached_device_memory() -> None:
    """Give the caching allocator's free blocks back to the GPU, and start its statistics anew, so
    that a reused worker's next run measures its own memory (nothing on a CPU worker)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def leftover_tensor_bytes() -> int:
    """The tensor bytes this process still holds: on a GPU what CUDA's allocator has handed out,
    on a CPU every live tensor's storage (:func:`orch.launchers.memory_probe.live_tensor_bytes`)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_allocated()
    from orch.launchers.memory_probe import live_tensor_bytes

    return live_tensor_bytes()
