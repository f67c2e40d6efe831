"""DeepSpeed's faster GPU defaults in the generated config, and the CPU config unchanged."""

import dataclasses

from conftest import compose_config
from launchers.ds_config import build_ds_config
from orchestrator.config import to_typed
from plans.resolve import resolve_plan
from plans.spec import Accelerator


def _configs(*overrides):
    cfg, _, _ = to_typed(compose_config(*overrides))
    cpu = resolve_plan(cfg.plan, cfg.cluster, cfg.train)
    gpu = dataclasses.replace(cpu, accelerator=Accelerator.gpu)
    return [build_ds_config(plan, cfg.optim, cfg.train.steps) for plan in (cpu, gpu)]


def test_overlap_comm_on_gpu_only():
    cpu, gpu = _configs("plan.zero_stage=2")
    assert cpu["zero_optimization"]["overlap_comm"] is False
    assert gpu["zero_optimization"]["overlap_comm"] is True


def test_offload_pins_memory_on_gpu_only():
    cpu, gpu = _configs("plan.zero_stage=3", "plan.offload_optimizer=cpu")
    assert cpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert gpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
