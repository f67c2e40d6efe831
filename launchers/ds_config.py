"""Generate the DeepSpeed config from a resolved plan; users never hand-write DeepSpeed JSON.

The bucket and ZeRO-3 limits are written out explicitly (at DeepSpeed's defaults) rather than
left implicit, so the planner reads the same numbers DeepSpeed will use.
"""

from __future__ import annotations

from plans.resolve import ResolvedPlan
from plans.spec import Accelerator, Offload, OptimizerName, OptimSpec, Precision

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), in elements.
REDUCE_BUCKET_SIZE = 500_000_000
ALLGATHER_BUCKET_SIZE = 500_000_000
STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
STAGE3_MAX_REUSE_DISTANCE = 1_000_000_000

_OPTIMIZER_TYPE = {OptimizerName.adam: "Adam", OptimizerName.adamw: "AdamW", OptimizerName.sgd: "SGD"}


def _offload_section(device: Offload, plan: ResolvedPlan) -> dict:
    section: dict = {"device": device.value, "pin_memory": plan.accelerator == Accelerator.gpu}
    if device == Offload.nvme:
        section["nvme_path"] = plan.nvme_path
    return section


def optimizer_section(optim: OptimSpec, plan: ResolvedPlan) -> dict:
    params: dict = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    if optim.name == OptimizerName.sgd:
        params["momentum"] = optim.momentum
    else:
        params["betas"] = list(optim.betas)
        params["eps"] = 1e-8
        # Without offload on CPU workers, torch's Adam avoids JIT-building DeepSpeed's FusedAdam,
        # which needs CUDA; with offload DeepSpeed picks its CPU Adam itself.
        if plan.accelerator == Accelerator.cpu and plan.offload_optimizer == Offload.none:
            params["torch_adam"] = True
    return {"type": _OPTIMIZER_TYPE[optim.name], "params": params}


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


BUCKET_ALIGNMENT = 1024
"""Bucket sizes are multiples of this many elements (a multiple of every alignment DeepSpeed asks)."""


def build_ds_config(plan: ResolvedPlan, optim: OptimSpec, total_steps: int, *,
                    param_count: int | None = None, tp_layer_specs: list[dict] | None = None) -> dict:
    """The DeepSpeed config dict for ``deepspeed.initialize(config=...)``.

    With ``param_count`` the communication buckets are capped at the model's size: DeepSpeed
    allocates its reduce bucket at full size (500M elements = 2 GB in fp32) whatever the model,
    which a small model never fills. The cap is rounded up to a multiple of
    :data:`BUCKET_ALIGNMENT`: ZeRO-2 refuses a bucket that is not a multiple of its
    alignment factor (2 to 8 elements, by dtype and world size).

    With ``plan.tp > 1`` the config gains a ``tensor_parallel`` section (see
    :func:`tensor_parallel_section`) sharding the layers ``tp_layer_specs`` names (the workload's:
    there is no default, a model's specs fit that model only). ``train_batch_size`` stays
    micro × accumulation × dp: the ranks of one tensor-parallel group share their batch.
    """
    cap = -(-param_count // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT if param_count else REDUCE_BUCKET_SIZE
    zero: dict = {
        "stage": plan.zero_stage,
        "reduce_bucket_size": min(REDUCE_BUCKET_SIZE, cap),
        "allgather_bucket_size": min(ALLGATHER_BUCKET_SIZE, cap),
        # Overlapping the gradient reduction with backward costs a second reduce bucket, which
        # plans/memory.py counts; on GPU it hides NCCL time, on CPU (gloo) there is nothing to hide.
        "overlap_comm": plan.accelerator == Accelerator.gpu,
        "contiguous_gradients": True,
    }
    if plan.zero_stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": STAGE3_PREFETCH_BUCKET_SIZE,
            "stage3_param_persistence_threshold": STAGE3_PARAM_PERSISTENCE_THRESHOLD,
            "stage3_max_live_parameters": STAGE3_MAX_LIVE_PARAMETERS,
            "stage3_max_reuse_distance": STAGE3_MAX_REUSE_DISTANCE,
        })
    if plan.offload_optimizer != Offload.none:
        zero["offload_optimizer"] = _offload_section(plan.offload_optimizer, plan)
    if plan.offload_param != Offload.none:
        zero["offload_param"] = _offload_section(plan.offload_param, plan)

    config = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": optim.grad_clip,
        "steps_per_print": 1_000_000_000,  # we report progress ourselves
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == Precision.bf16},
        "fp16": {"enabled": plan.precision == Precision.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": optimizer_section(optim, plan),
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(total_steps, 1),
                "warmup_num_steps": max(min(optim.warmup_steps, total_steps), 1),
                "warmup_min_ratio": 0.0,
                "warmup_type": "linear",
                "cos_min_ratio": optim.min_lr_ratio,
            },
        },
    }
    if plan.tp > 1:
        if not tp_layer_specs:
            raise ValueError(f"plan.tp={plan.tp} needs the model's tensor-parallel layer specs")
        config["tensor_parallel"] = tensor_parallel_section(plan.tp, tp_layer_specs)
    if optim.name == OptimizerName.sgd and plan.zero_stage > 0:
        # DeepSpeed only whitelists Adam-family optimizers under ZeRO; torch's SGD partitions fine.
        config["zero_allow_untested_optimizer"] = True
    return config
