"""The worker's side of the GPU mapping: report what Ray assigned, then use the mapped device.

Apart from :mod:`launchers.devices` because these touch the process (Ray's runtime context,
``os.environ``, CUDA); the decisions stay pure there.
"""

from __future__ import annotations

import os
import re

from launchers.devices import DeviceMapping


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


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT builder can read it.

    torch accepts architecture-specific entries (``9.0a`` for Hopper's wgmma, ``10.0f``), and
    machines built for one GPU generation set them; DeepSpeed 0.19 parses every part of an entry
    as an integer and fails on them (``invalid literal for int() with base 10: '0a'``). Its
    kernels use no architecture-specific instructions, so the plain entry builds the same code
    for the same GPU.
    """
    entries = [entry for entry in value.replace(" ", ";").split(";") if entry]
    return ";".join(re.sub(r"^(\d+\.\d+)[af]", r"\1", entry) for entry in entries)


def fused_adam_problem() -> str | None:
    """Why DeepSpeed's FusedAdam cannot run on this node, or None once it is loaded (prebuilt,
    or built now by the CUDA compiler into torch's extension cache).

    Building it here, rather than inside ``deepspeed.initialize``, turns a failed build into a
    fallback to torch's fused AdamW instead of a failed run.
    """
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list and deepspeed_arch_list(arch_list) != arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arch_list)
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import CUDA_HOME

        if installed_ops.get("fused_adam"):
            return None
        builder = get_accelerator().create_op_builder("FusedAdamBuilder")
        if CUDA_HOME is None or builder is None:
            return "no CUDA compiler on this node and no prebuilt op"
        if not builder.is_compatible(verbose=False):
            return "DeepSpeed finds it incompatible with this node"
        builder.load(verbose=False)
        return None
    except Exception as error:  # noqa: BLE001 - any failure to build means it cannot be relied on
        lines = str(error).strip().splitlines()
        return f"building it failed: {type(error).__name__}: {lines[-1][:200] if lines else ''}"


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
