"""The engine-neutral optimizer settings (:mod:`orch.plans.optim_settings`): decided once from the
config, written out as DeepSpeed's sections unchanged, carried by every engine's job. Pure: no
engine starts."""

from __future__ import annotations

import json

import pytest

from helpers.config import compose_config
from orch.config import to_typed
from orch.launchers.engines.deepspeed.config import build_ds_config
from orch.plans.optim_settings import optim_settings
from orch.plans.resolve import ResolvedPlan, resolve_plan
from orch.plans.spec import Accelerator, Offload, OptimizerName, OptimSpec, Precision


def _plan(engine: str = "deepspeed", precision: Precision = Precision.bf16) -> ResolvedPlan:
    return ResolvedPlan(dp=2, tp=1, pp=1, world_size=2, zero_stage=3, offload_optimizer=Offload.none,
                        offload_param=Offload.none, nvme_path=None, activation_checkpointing=False,
                        micro_batch_size=2, grad_accum_steps=1, precision=precision, accelerator=Accelerator.cpu,
                        engine=engine)


@pytest.mark.parametrize(("steps", "warmup", "expected"), [(100, 10, (100, 10)), (5, 10, (5, 5)), (20, 0, (20, 1)),
                                                           (0, 10, (1, 1))])
def test_warmup_fits_in_the_run_and_lasts_at_least_one_step(steps, warmup, expected):
    schedule = optim_settings(_plan(), OptimSpec(warmup_steps=warmup), steps).schedule
    assert (schedule.total_num_steps, schedule.warmup_num_steps) == expected
    assert (schedule.warmup_type, schedule.warmup_min_ratio) == ("linear", 0.0)


def test_deepspeed_sections_are_the_settings_written_out():
    plan = _plan(precision=Precision.fp16)
    settings = optim_settings(plan, OptimSpec(lr=0.02, betas=[0.8, 0.9], min_lr_ratio=0.2, grad_clip=0.5), 50)
    config = build_ds_config(plan, settings)
    assert config["optimizer"] == {"type": "AdamW", "params": {
        "lr": 0.02, "weight_decay": 0.01, "betas": [0.8, 0.9], "eps": 1e-8, "torch_adam": True}}
    assert config["scheduler"] == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 50, "warmup_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_type": "linear",
        "cos_min_ratio": 0.2}}
    assert config["gradient_clipping"] == 0.5
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert config["bf16"] == {"enabled": False}
    sgd = optim_settings(plan, OptimSpec(name=OptimizerName.sgd, lr=0.1, momentum=0.9, weight_decay=0.0), 50)
    assert build_ds_config(plan, sgd)["optimizer"] == {"type": "SGD", "params": {
        "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9}}


def test_tracked_form_names_only_the_optimizers_own_hyper_parameters():
    adamw = optim_settings(_plan(), OptimSpec(), 10).as_dict()
    assert json.loads(json.dumps(adamw)) == adamw
    assert adamw["optimizer"] == {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "betas": [0.9, 0.95],
                                  "eps": 1e-8}
    assert adamw["loss_scaling"]["enabled"] is False
    sgd = optim_settings(_plan(), OptimSpec(name=OptimizerName.sgd, momentum=0.9), 10).as_dict()
    assert sgd["optimizer"] == {"name": "sgd", "lr": 3e-3, "weight_decay": 0.01, "momentum": 0.9}


def test_composed_config_gives_the_same_settings_the_driver_would():
    cfg, _, _ = to_typed(compose_config("optim=sgd", "train.steps=40"))
    plan = resolve_plan(cfg.plan, cfg.cluster, cfg.train)
    settings = optim_settings(plan, cfg.optim, cfg.train.steps)
    assert (settings.name, settings.lr, settings.momentum) == (OptimizerName.sgd, cfg.optim.lr, cfg.optim.momentum)
    assert settings.schedule.total_num_steps == 40


def test_each_engine_builds_its_own_config_for_the_job():
    """The driver asks the run's engine for the job's config: DeepSpeed's JSON, with the same
    optimizer settings; FSDP2 reads the settings alone and builds none."""
    from orch.launchers.engines import engine_module

    for engine in ("deepspeed", "fsdp2"):
        plan = _plan(engine)
        settings = optim_settings(plan, OptimSpec(), 10)
        config = engine_module(engine, "driver").engine_config(plan, settings, param_count=10, tp_layer_specs=None)
        if engine == "deepspeed":
            assert config == build_ds_config(plan, settings, param_count=10)
            assert config["optimizer"]["params"]["lr"] == settings.lr
        else:
            assert config is None
