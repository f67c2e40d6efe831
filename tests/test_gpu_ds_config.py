"""DeepSpeed's faster GPU defaults in the generated config, and the CPU config unchanged."""

import dataclasses

from helpers.config import compose_config
from orch.config import to_typed
from orch.launchers.engines.deepspeed.config import build_ds_config
from orch.plans.optim_settings import optim_settings
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Accelerator


def _configs(*overrides):
    cfg, _, _ = to_typed(compose_config(*overrides))
    cpu = resolve_plan(cfg.plan, cfg.cluster, cfg.train)
    gpu = dataclasses.replace(cpu, accelerator=Accelerator.gpu)
    return [build_ds_config(plan, optim_settings(plan, cfg.optim, cfg.train.steps)) for plan in (cpu, gpu)]


def test_overlap_comm_on_gpu_only():
    cpu, gpu = _configs("plan.zero_stage=2")
    assert cpu["zero_optimization"]["overlap_comm"] is False
    assert gpu["zero_optimization"]["overlap_comm"] is True


def test_offload_pins_memory_on_gpu_only():
    cpu, gpu = _configs("plan.zero_stage=3", "plan.offload_optimizer=cpu")
    assert cpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert gpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is True


def test_torchs_fused_adamw_replaces_fusedadam_only_where_it_would_be_built():
    """A GPU node that cannot build DeepSpeed's FusedAdam trains with torch's fused AdamW; CPU
    offload (DeepSpeed's CPU Adam), SGD and configs already on torch's Adam are left alone."""
    from orch.launchers.engines.deepspeed.config import without_fused_adam

    _, gpu = _configs("plan.zero_stage=2")
    swapped = without_fused_adam(gpu)
    assert swapped["optimizer"]["type"] == "AdamW"
    assert swapped["optimizer"]["params"] == {**gpu["optimizer"]["params"], "torch_adam": True, "fused": True}
    assert "torch_adam" not in gpu["optimizer"]["params"], "the planned config is not changed"
    _, offloaded = _configs("plan.zero_stage=2", "plan.offload_optimizer=cpu")
    _, sgd = _configs("optim=sgd")
    cpu, _ = _configs("plan.zero_stage=2")  # CPU workers are on torch's Adam already
    for config in (offloaded, sgd, cpu):
        assert without_fused_adam(config) is config


def test_the_fallback_builds_the_optimizer_deepspeed_would_take():
    """DeepSpeed turns torch_adam + fused into torch.optim.AdamW(fused=True); torch accepts those
    arguments (the CUDA kernel itself needs a GPU, so only the construction is checked here)."""
    import torch

    from orch.launchers.engines.deepspeed.config import without_fused_adam

    _, gpu = _configs("plan.zero_stage=2")
    params = dict(without_fused_adam(gpu)["optimizer"]["params"])
    assert params.pop("torch_adam") is True
    weight = torch.nn.Parameter(torch.zeros(2, device="meta"))
    optimizer = torch.optim.AdamW([weight], **params, foreach=None)
    assert optimizer.defaults["fused"] is True


def test_arch_specific_cuda_arch_lists_are_given_to_deepspeed_in_a_form_it_reads(monkeypatch):
    """The lent H100 sets TORCH_CUDA_ARCH_LIST=9.0a: DeepSpeed's JIT builder failed to parse it
    and FusedAdam, then every GPU run, failed with "invalid literal for int() ... '0a'"."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from orch.launchers.engines.deepspeed.config import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0 9.0a+PTX;10.0f") == "8.0;9.0+PTX;10.0"
    assert deepspeed_arch_list("7.5;8.6") == "7.5;8.6"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", deepspeed_arch_list("8.0 9.0a+PTX"))
    builder.compute_capability_args()  # DeepSpeed's own parser takes what the workers give it


def test_the_optimizer_is_named_by_its_implementation():
    import torch

    from orch.launchers.engines.base import describe_optimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert describe_optimizer(torch.optim.AdamW(params, fused=True)) == "torch.AdamW (fused)"
    assert describe_optimizer(torch.optim.SGD(params, lr=0.1)) == "torch.SGD"
    assert describe_optimizer(None) == "none"
