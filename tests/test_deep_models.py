"""Deep models are checked from copies built at two shallow depths, and an absurd depth is refused
from their arithmetic: the full-depth model is never built (orch/plans/depth_scaling.ShallowModels).

How long a check takes is measured by hand (bench/planner_speed.py), not asserted here.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.config import compose_config, lm_inputs
from helpers.orch_command import orch_run
from orch import models
from orch.checking import check_run
from orch.config import to_typed
from orch.plans.engines.deepspeed_partition import partition_balanced
from orch.plans.errors import PlanError
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS
from orch.tune.search import prepare
from orch.workloads.gpt import GPT


@pytest.fixture
def depths_built(monkeypatch) -> list[int]:
    """The n_layer of every GPT, and of every run of its pipeline layers, built while the test runs."""
    built: list[int] = []
    init, layers = GPT.__init__, GPT.pipeline_layers.__func__

    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("n_layer", 2))
        init(self, *args, **kwargs)

    def counting_layers(cls, **kwargs):
        built.append(kwargs.get("n_layer", 2))
        return layers(cls, **kwargs)

    monkeypatch.setattr(GPT, "__init__", counting_init)
    monkeypatch.setattr(GPT, "pipeline_layers", classmethod(counting_layers))
    return built


def check(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return check_run(typed, model_cfg)[0]


def gpt_params(n_layer: int, d: int = 128, vocab: int = 256, seq_len: int = 128) -> int:
    """The built-in GPT's parameters (tied head): 12d^2 + 13d per block, embeddings and ln_f."""
    return n_layer * (12 * d * d + 13 * d) + vocab * d + seq_len * d + 2 * d


def test_a_2000_layer_model_is_checked_without_building_it(depths_built):
    estimate = check("model.n_layer=2000")
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]
    assert estimate.model.param_count == gpt_params(2000)
    assert not estimate.feasible  # 1.5 GiB of fp32 parameters, 16 bytes each with Adam, on 8 GiB devices
    assert estimate.violations[0].field == "cluster.device_memory_gib" and estimate.suggestions


@pytest.mark.parametrize("plan", [(),
                                  ("plan.zero_stage=3", "plan.activation_checkpointing=true", "plan.precision=bf16"),
                                  ("plan.tp=2", "plan.dp=1", "plan.micro_batch_size=4"),
                                  ("plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=4")],
                         ids=["ddp", "zero3 checkpointed bf16", "tp", "pp"])
def test_counts_carried_from_shallow_copies_equal_full_counts(plan, depths_built, monkeypatch):
    """Every number of `orch check --json` at a depth cheap enough to count in full (odd, so the
    extrapolation's halves are exercised)."""
    carried = check("model.n_layer=21", *plan).as_json()
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]
    monkeypatch.setattr(models, "declared_depth", lambda _cfg: None)
    assert carried == check("model.n_layer=21", *plan).as_json()


def test_a_deep_pipeline_is_split_from_shallow_layers(depths_built):
    estimate = check("model.n_layer=2000", "plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=4")
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]
    first, second = estimate.pipeline
    # Embedding, 2000 blocks, the final norm and the tied head, split by parameters as DeepSpeed does.
    assert (first.start, second.stop) == (0, 2003) and first.stop == second.start
    # The tied head is a second copy of the embedding (tokens and positions) on the last stage.
    assert first.params + second.params == gpt_params(2000) + 256 * 128 + 128 * 128


def test_a_probe_of_shallow_copies_counts_the_costs_of_the_full_model():
    """FLOPs, kernel launches, all-reduce sizes (what the tuner's cost model reads) at 21 layers."""
    import functools

    from orch.plans.memory.estimate import ModelProbe
    from orch.plans.model.model_facts import inspect_shallow
    from orch.plans.step_time.model_cost import measure_model_cost
    from orch.workloads.gpt import TP_LAYER_SPECS

    cfg = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 21, "d_model": 64, "n_head": 4, "seq_len": 64}
    _, shallow = inspect_shallow(functools.partial(models.build_at_depth, cfg), 21, lm_inputs(64))
    carried = ModelProbe(models.model_factory(cfg), lm_inputs(64), tp_layer_specs=TP_LAYER_SPECS, shallow=shallow)
    full = ModelProbe(models.model_factory(cfg), lm_inputs(64), tp_layer_specs=TP_LAYER_SPECS)
    assert measure_model_cost(carried, [1, 2], depth_scaled=True) == measure_model_cost(full, [1, 2])
    assert "module" not in vars(carried)  # the full-depth model was never built


def test_an_absurdly_deep_model_is_refused_before_it_is_built(depths_built):
    with pytest.raises(PlanError) as refused:
        check("model.n_layer=10000000")
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]
    fields = {v.field: v for v in refused.value.violations}
    assert set(fields) == {"model.n_layer"}
    message = str(refused.value)
    assert "10,000,000 layers of 198,272 parameters each make 1,982,720,049,408 parameters" in message
    assert "more than the 40.0 GiB of the whole cluster" in message
    assert "use at most 54,154 layers (model.n_layer=54154)" in message
    # 9 a block, and 7 more: the GPT, its embedding (with wte and wpe), the block list, ln_f and the tied head.
    assert "90,000,007 torch modules" in message


def test_a_model_too_large_for_the_cluster_is_refused_whatever_the_layout(depths_built):
    # 20000 layers: 4 billion parameters, 7.4 GiB in bf16, on 2 devices of 1 GiB and 4 GiB of host memory.
    with pytest.raises(PlanError, match=r"model.n_layer=20000: .* more than the 6.0 GiB of the whole cluster"):
        check("model.n_layer=20000", "plan.precision=bf16", "cluster.device_memory_gib=1", "cluster.host_memory_gib=4")
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]


def test_the_tuner_probes_a_deep_model_from_shallow_copies(depths_built):
    typed, model_cfg, _ = to_typed(compose_config("model.n_layer=2000"))
    _, ctx = prepare(typed, model_cfg, typed.cluster)
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]
    assert ctx.model_cost.n_layers == 2000 and ctx.probe.stats.param_count == gpt_params(2000)


class FirstBlockDiffers(GPT):
    """A GPT whose first block has no first LayerNorm: its blocks are not all alike."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks[0].ln_1 = torch.nn.Identity()


def test_a_model_of_unlike_layers_is_counted_in_full_but_still_refused_from_shallow_copies(depths_built):
    unlike = "model._target_=test_deep_models.FirstBlockDiffers"
    assert check(unlike, "model.n_layer=20").model.param_count == gpt_params(20) - 2 * 128
    assert max(depths_built) == 20  # carried counts would not be exact: the model was built in full
    depths_built.clear()
    with pytest.raises(PlanError, match="model.n_layer=10000000: 10,000,000 layers of 198,272 parameters"):
        check(unlike, "model.n_layer=10000000")
    assert max(depths_built) <= SHALLOW_DEPTHS[-1]


class AtLeastEightLayers(GPT):
    def __init__(self, *, n_layer: int, **kwargs):
        if n_layer < 8:
            raise ValueError(f"this model needs 8 layers or more, not {n_layer}")
        super().__init__(n_layer=n_layer, **kwargs)


def test_a_model_that_cannot_be_built_shallow_is_inspected_at_its_depth(depths_built):
    estimate = check("model._target_=test_deep_models.AtLeastEightLayers", "model.n_layer=16")
    assert estimate.model.param_count == gpt_params(16) and 16 in depths_built


@pytest.mark.parametrize("command", ["check", "train"])
def test_an_absurd_depth_is_refused_with_exit_code_2_and_no_ray_output(command, tmp_path):
    done = orch_run([command, "model.n_layer=10000000", "train.force=true"], cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "model.n_layer=10000000" in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stderr


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.one_of(st.integers(0, 1), st.sampled_from([0, 5, 100]), st.integers(0, 10**9)),
                        max_size=40),
       parts=st.integers(1, 8))
def test_the_vectorized_balanced_partition_is_deepspeeds(weights, parts):
    """Ties included (layers of equal weight, zero weights of a type: partition): the same parts."""
    from deepspeed.runtime.utils import partition_balanced as deepspeeds

    assert partition_balanced(weights, parts) == [int(p) for p in deepspeeds(weights, parts)]


def test_the_uniform_partition_is_deepspeeds():
    """Both engines cut stages with it, without importing DeepSpeed: the same bounds as DeepSpeed's."""
    from deepspeed.runtime.utils import partition_uniform as deepspeeds

    from orch.plans.engines.deepspeed_partition import partition_uniform

    for items in range(40):
        for parts in range(1, 12):
            assert partition_uniform(items, parts) == [int(p) for p in deepspeeds(items, parts)]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_hugging_face_decoders_activations_are_carried_from_shallow_copies(checkpointing, tmp_path):
    """A Llama-shaped decoder's first layer holds tensors the later ones reuse, so its trace is not
    one line from layer 0: the peaks are still carried from the shallow copies (not counted at the
    full depth) and equal the full count, for the GPU's attention kernels and the CPU's."""
    import json

    from orch.plans.memory.activations import activations_from_shallow, measure_activations
    from orch.plans.model.depth_scaling import ShallowModels, repeated_stack, shallow_copy
    from orch.plans.model.meta import meta_device
    from orch.plans.spec import Accelerator
    from orch.workload import resolve_workload

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 9,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}))
    typed, model_cfg, _ = to_typed(compose_config("model=hf_causal_lm", "model.config=null",
                                                  f"model.config_path={tmp_path}", "data.seq_len=32"))
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    with meta_device():
        model = workload.model_factory()
    stack = repeated_stack(model)
    shallow = ShallowModels(depth=len(stack), shallow=shallow_copy(model, stack, SHALLOW_DEPTHS[0]),
                            deeper=shallow_copy(model, stack, SHALLOW_DEPTHS[1]))
    for accelerator in (Accelerator.gpu, Accelerator.cpu):
        args = dict(micro_batch_size=2, inputs=workload, dtype=torch.bfloat16, checkpointing=checkpointing,
                    accelerator=accelerator)
        carried = activations_from_shallow(shallow, **args)
        assert carried is not None
        assert carried == measure_activations(model, **args)


# Hugging Face models: the depth is the config's num_hidden_layers, given as a dict or in a file.

HF_EXAMPLE = ("model=hf_causal_lm", "data.seq_len=64")


@pytest.fixture
def hf_depths_built(monkeypatch) -> list[int]:
    """The num_hidden_layers of every Hugging Face model built while the test runs."""
    from transformers import AutoModelForCausalLM

    built: list[int] = []
    from_config = AutoModelForCausalLM.from_config.__func__

    def counting(cls, config, **kwargs):
        built.append(config.num_hidden_layers)
        return from_config(cls, config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", classmethod(counting))
    return built


def hf_params(layers: int) -> int:
    """The example model's parameters at ``layers``, on the line through two depths built in full."""
    from orch.plans.model.meta import meta_device
    from orch.workloads.hf import hf_causal_lm

    config = compose_config("model=hf_causal_lm").model.config
    with meta_device():
        four, eight = (sum(p.numel() for p in hf_causal_lm(config={**config, "num_hidden_layers": n}).parameters())
                       for n in (4, 8))
    return four + (eight - four) // 4 * (layers - 4)


def test_a_2000_layer_hugging_face_model_is_checked_from_shallow_copies(tmp_path):
    """`orch check` built all 2000 layers on meta and gave no answer in 120 s; the timeout only
    guards against that hang (how long a check takes is measured in bench/, not here)."""
    done = orch_run(["check", "--json", "model=hf_causal_lm",
                     "model.config.num_hidden_layers=2000"], cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]  # it does not fit 8 GiB devices: an answer all the same
    assert json.loads(done.stdout)["model"]["param_count"] == hf_params(2000)


@pytest.mark.parametrize("plan", [(), ("plan.tp=2", "plan.dp=1", "plan.micro_batch_size=4"),
                                  ("plan.pp=2", "plan.dp=1", "plan.grad_accum_steps=4")], ids=["ddp", "tp", "pp"])
def test_hugging_face_counts_carried_from_shallow_copies_equal_full_counts(plan, hf_depths_built, monkeypatch):
    """Every number of `orch check --json` for the example decoder at 21 layers, from its copies of
    2 and 4 layers and from the model built in full (pipeline layers included)."""
    carried = check(*HF_EXAMPLE, "model.config.num_hidden_layers=21", *plan).as_json()
    assert hf_depths_built and max(hf_depths_built) <= SHALLOW_DEPTHS[-1]
    assert carried["model"]["param_count"] == hf_params(21)
    monkeypatch.setattr(models, "declared_depth", lambda _cfg: None)
    assert carried == check(*HF_EXAMPLE, "model.config.num_hidden_layers=21", *plan).as_json()
    assert max(hf_depths_built) == 21


def test_a_million_layer_hugging_face_config_file_is_refused_naming_the_file(tmp_path, hf_depths_built):
    """The file's num_hidden_layers made `orch check` grow by 25 MiB/s building layers on meta."""
    config = {**compose_config("model=hf_causal_lm").model.config, "num_hidden_layers": 1_000_000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(config)))
    with pytest.raises(PlanError) as refused:
        check(*HF_EXAMPLE, "model.config=null", f"model.config_path={path}")
    assert max(hf_depths_built) <= SHALLOW_DEPTHS[-1]
    assert {v.field for v in refused.value.violations} == {"model.config_path"}
    message = str(refused.value)
    assert f"1,000,000 layers of 164,096 parameters each make {hf_params(1_000_000):,} parameters" in message
    assert f'use at most 65,433 layers ("num_hidden_layers": 65433 in {path})' in message
    assert "1,000,000 layers of 13 modules each" in message and f"(num_hidden_layers in {path})" in message
