"""Hydra composition: every config in orch/conf/ composes, converts to the typed schema and
instantiates; mistakes fail at composition, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from helpers.config import REPO, compose_config
from orch.config import ConfigError, RunConfig, to_typed
from orch.launchers.engines.deepspeed.config import build_ds_config
from orch.models import build_model
from orch.plans.optim_settings import optim_settings
from orch.plans.resolve import resolve_plan
from orch.plans.spec import PlanSpec
from orch.workload import resolve_workload

CONFS = REPO / "orch" / "conf"
GROUPS = sorted(p.name for p in CONFS.iterdir() if p.is_dir() and not p.name.startswith("_"))
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((CONFS / group).glob("*.yaml"))]


def test_every_group_has_options():
    assert set(GROUPS) >= {"model", "data", "plan", "cluster", "optim", "tracking"}


# Options that only make sense with others: composed together with them.
COMPANIONS = {
    "objective=classification": ("model=vit", "data=images"),
    "data=images": ("model=vit", "objective=classification"),
    "model=vit": ("data=images", "objective=classification"),
    "model=torchvision": ("data=images", "objective=classification"),
    "data=dataset": ("model=mlp", "objective=classification"),
    "model=mlp": ("data=dataset", "objective=classification"),
}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_config_composes_and_instantiates(group, option):
    cfg = compose_config(f"{group}={option}", *COMPANIONS.get(f"{group}={option}", ()))
    typed, model_cfg, yaml = to_typed(cfg)
    assert isinstance(typed, RunConfig) and isinstance(typed.plan, PlanSpec)
    assert f"{group}:" in yaml
    # The model, objective and data source all instantiate, and the model's output on the data
    # source's batch goes through the objective to one loss, on the meta device (model=gpt3_175b
    # would need 700 GB for real).
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    with torch.device("meta"):
        model = build_model(model_cfg)
        loss = workload.loss(model, workload.example_batch(2))
    assert isinstance(model, torch.nn.Module)
    assert loss.shape == ()
    if group == "plan":
        # Plans that fit this machine's default cluster also generate their engine's settings:
        # the optimizer's for every engine, and a DeepSpeed config for DeepSpeed's.
        resolved = resolve_plan(typed.plan, typed.cluster, typed.train)
        optim = optim_settings(resolved, typed.optim, typed.train.steps)
        assert optim.loss_scaling.enabled == (resolved.precision.value == "fp16")
        if typed.plan.engine == "deepspeed":
            ds_config = build_ds_config(resolved, optim, tp_layer_specs=workload.tp_layer_specs)
            assert ds_config["zero_optimization"]["stage"] == typed.plan.zero_stage


def test_data_seq_len_follows_the_model():
    typed, _, _ = to_typed(compose_config("model.seq_len=64"))
    assert typed.data["seq_len"] == 64


@pytest.mark.parametrize("override,key,schema", [
    ("plan.zero_stagee=1", "zero_stagee", "PlanSpec"),
    ("model.n_layr=3", "n_layr", "GPTModelConfig"),
    ("cluster.adress=auto", "adress", "ClusterSpec"),
])
def test_a_typo_key_fails_naming_the_key(override, key, schema):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(override)
    message = str(info.value.__cause__)
    assert f"Key '{key}' not in '{schema}'" in message
    assert f"full_key: {override.split('=')[0]}" in message


def test_an_appended_typo_key_fails_too():
    # Hydra lets `+key=value` through composition; our conversion refuses it.
    cfg = compose_config("+plan.zero_stagee=1", "+train.stepz=3")
    with pytest.raises(ConfigError) as info:
        to_typed(cfg)
    assert "plan.zero_stagee: PlanSpec has no key 'zero_stagee'" in str(info.value)
    assert "train.stepz: TrainSpec has no key 'stepz'" in str(info.value)


def test_a_bad_enum_value_names_the_choices():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("plan.precision=fp64")
    cause = info.value.__cause__
    assert isinstance(cause, ValidationError)
    assert "Invalid value 'fp64', expected one of [fp32, bf16, fp16, fp8]" in str(cause)
    assert "full_key: plan.precision" in str(cause)


def test_yaml_files_extend_their_schema():
    for group, option in OPTIONS:
        text = (CONFS / group / f"{option}.yaml").read_text()
        # Model files of any class may be schema-free; experiments hold overrides only.
        if (group != "model" or option == "gpt") and group != "experiment":
            assert "_schema" in text, f"orch/conf/{group}/{option}.yaml does not extend a schema"


def test_the_default_run_takes_the_loop_tuner_and_optimizer_defaults_from_their_schemas():
    """One source of truth: no YAML file restates (or contradicts) what the schemas declare."""
    from orch.config import TuneConfig
    from orch.plans.spec import OptimSpec, TrainSpec

    typed, _, _ = to_typed(compose_config())
    assert typed.train == TrainSpec() and typed.tune == TuneConfig() and typed.optim == OptimSpec()
    assert "train:" not in (CONFS / "config.yaml").read_text()


def test_package_data_ships_the_configs():
    assert Path(CONFS / "__init__.py").exists()
