"""Generate the DeepSpeed config from a resolved plan; users never hand-write DeepSpeed JSON.

The settings themselves are decided in :mod:`orch.plans.engine_settings` (the planner reads the same object)
and :mod:`orch.plans.optim_settings` (every engine reads that one); this module only writes them out
as DeepSpeed's JSON, every bucket and ZeRO-3 limit explicit.
"""

from __future__ import annotations

import dataclasses
import os
import re

from orch.plans.engine_settings import EngineSettings, engine_settings
from orch.plans.optim_settings import LossScaling, OptimSettings, WarmupCosine
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Offload, OptimizerName, Precision

_OPTIMIZER_TYPE = {OptimizerName.adam: "Adam", OptimizerName.adamw: "AdamW", OptimizerName.sgd: "SGD"}


def _offload_section(device: Offload, engine: EngineSettings) -> dict:
    section: dict = {"device": device.value, "pin_memory": engine.pin_memory}
    if device == Offload.nvme:
        section["nvme_path"] = engine.nvme_path
    return section


def optimizer_section(optim: OptimSettings, engine: EngineSettings) -> dict:
    """DeepSpeed's ``optimizer`` section: ``optim``'s optimizer, run by torch's Adam where
    ``engine`` says so."""
    params = optim.hyperparameters()
    if optim.adam_family and engine.torch_adam:
        params["torch_adam"] = True
    return {"type": _OPTIMIZER_TYPE[optim.name], "params": params}


def zero_section(engine: EngineSettings) -> dict:
    """DeepSpeed's ``zero_optimization`` section of ``engine``."""
    zero: dict = {
        "stage": int(engine.zero_stage),
        "reduce_bucket_size": engine.reduce_bucket_size,
        "allgather_bucket_size": engine.allgather_bucket_size,
        "overlap_comm": engine.overlap_comm,
        "contiguous_gradients": engine.contiguous_gradients,
    }
    if engine.zero_stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": engine.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": engine.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": engine.stage3_max_live_parameters,
            "stage3_max_reuse_distance": engine.stage3_max_reuse_distance,
            "sub_group_size": engine.sub_group_size,
        })
    if engine.offload_optimizer != Offload.none:
        zero["offload_optimizer"] = _offload_section(engine.offload_optimizer, engine)
    if engine.offload_param != Offload.none:
        zero["offload_param"] = _offload_section(engine.offload_param, engine)
    return zero


def without_fused_adam(config: dict) -> dict:
    """``config`` with torch's fused AdamW in place of DeepSpeed's FusedAdam, for GPU workers that
    cannot build FusedAdam (no CUDA compiler on the node, no prebuilt op).

    DeepSpeed builds FusedAdam with the CUDA toolkit at its first use; ``torch_adam`` makes it
    take ``torch.optim.Adam``/``AdamW`` instead, and ``fused`` selects torch's own fused CUDA
    kernel, shipped compiled inside the torch wheel. Offloaded optimizers (DeepSpeed's CPU Adam,
    built with the host compiler) and SGD are left as they are; so is a config already on torch's
    Adam.
    """
    optimizer = config.get("optimizer", {})
    params = optimizer.get("params", {})
    offloaded = "offload_optimizer" in config.get("zero_optimization", {})
    if optimizer.get("type") not in ("Adam", "AdamW") or offloaded or params.get("torch_adam"):
        return config
    return {**config, "optimizer": {**optimizer, "params": {**params, "torch_adam": True, "fused": True}}}


def tensor_parallel_section(tp: int, layer_specs: list[dict]) -> dict:
    """DeepSpeed's AutoTP training section: shard the layers ``layer_specs`` name over ``tp`` ranks.

    ``layer_specs`` follow ``tensor_parallel.partition_config.layer_specs``
    (deepspeed/module_inject/autotp_config.py): ``patterns`` (regexes over full parameter names),
    ``partition_type`` (``column``, ``row`` or ``skip``) and optionally ``shape`` and
    ``partition_dim`` for fused weights. DeepSpeed's own per-architecture defaults are turned off
    (``use_default_specs: false``): only what the model declares is sharded, and every layer no
    pattern matches stays replicated. ``deepspeed.initialize`` applies the sharding itself, before
    ZeRO sees the parameters; no ``tp_model_init`` call is needed (the worker passes DeepSpeed's
    tensor/data-parallel groups as ``mpu`` only so the batch check counts dp ranks).
    """
    if not layer_specs:
        raise ValueError(f"plan.tp={tp} needs the model's tensor-parallel layer specs; none were given")
    return {
        "autotp_size": tp,
        "partition_config": {"use_default_specs": False, "layer_specs": [dict(spec) for spec in layer_specs]},
    }


def scheduler_section(schedule: WarmupCosine) -> dict:
    """DeepSpeed's ``scheduler`` section: its ``WarmupCosineLR`` with ``schedule``'s parameters."""
    return {"type": "WarmupCosineLR", "params": dataclasses.asdict(schedule)}


def fp16_section(scaling: LossScaling) -> dict:
    """DeepSpeed's ``fp16`` section (written, disabled, for the other precisions too)."""
    return dataclasses.asdict(scaling)


def build_ds_config(plan: ResolvedPlan, optim: OptimSettings, *,
                    param_count: int | None = None, tp_layer_specs: list[dict] | None = None) -> dict:
    """The DeepSpeed config dict for ``deepspeed.initialize(config=...)``: the plan's
    :func:`orch.plans.engine_settings.engine_settings` (``param_count`` caps the buckets at the model's size),
    the batch sizes and precision, and ``optim`` (:func:`orch.plans.optim_settings.optim_settings`)
    as DeepSpeed's optimizer, scheduler, clipping and fp16 sections.

    With ``plan.tp > 1`` the config gains a ``tensor_parallel`` section (see
    :func:`tensor_parallel_section`) sharding the layers ``tp_layer_specs`` names (the workload's:
    there is no default, a model's specs fit that model only). ``train_batch_size`` stays
    micro × accumulation × dp: the ranks of one tensor-parallel group share their batch.
    """
    engine = engine_settings(plan, optim, param_count)
    zero = zero_section(engine)
    config = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": optim.grad_clip,
        "steps_per_print": 1_000_000_000,  # we report progress ourselves
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == Precision.bf16},
        "fp16": fp16_section(optim.loss_scaling),
        "optimizer": optimizer_section(optim, engine),
        "scheduler": scheduler_section(optim.schedule),
    }
    if plan.tp > 1:
        if not tp_layer_specs:
            raise ValueError(f"plan.tp={plan.tp} needs the model's tensor-parallel layer specs")
        config["tensor_parallel"] = tensor_parallel_section(plan.tp, tp_layer_specs)
    if optim.name == OptimizerName.sgd and plan.zero_stage > 0:
        # DeepSpeed only whitelists Adam-family optimizers under ZeRO; torch's SGD partitions fine.
        config["zero_allow_untested_optimizer"] = True
    return config


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
