"""``plan.precision=fp8``: the rules, the cost model's FP8 matmuls and casts, the tuner's axis, and
the fsdp2 engine training with torchao's float8 linear layers on a 2-rank gloo group."""

from __future__ import annotations

import json

import pytest

from helpers.config import compose_config
from helpers.processes import free_port
from orch.checking import checked_run
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Precision
from orch.plans.step_time.cost_model import FP8_CAST_BYTES, Gemm, ModelCost, fp8_matmuls
from orch.plans.step_time.prediction import declared_plan_step

H100 = ("model=hf_causal_lm", "cluster=h100_8x", "cluster.nodes=1", "plan.engine=fsdp2", "plan.tp=2")


def _typed(*overrides: str):
    return to_typed(compose_config(*overrides))[0]


def _refusal(*overrides: str, field: str = "plan.precision"):
    typed = _typed(*overrides)
    with pytest.raises(PlanError) as refused:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    [violation] = [v for v in refused.value.violations if v.field == field]
    return violation


def test_fp8_is_bf16_with_fp8_matmuls_on_gpus_that_declare_them():
    from orch.checking import step_assumptions

    typed = _typed(*H100, "plan.precision=fp8", "plan.fp8_recipe=rowwise")
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    assert "precision=fp8 fp8_recipe=rowwise micro_batch_size" in plan.layout_text()
    # `orch check` says what its predicted step assumed (h100_8x: 1979 / 989 TFLOP/s).
    assert step_assumptions(plan, typed.cluster) == [
        "FP8 matmuls in the blocks' linear layers (rowwise scaling) at 2x the bf16 rate, their casts included"]
    assert plan.as_dict()["fp8_recipe"] == "rowwise"
    assert Precision.fp8.dtype == Precision.bf16.dtype and Precision.fp8.element_bytes == 2
    assert Precision.fp8.base == Precision.bf16


@pytest.mark.parametrize(("overrides", "message", "fix"), [
    (("plan.engine=deepspeed", "plan.zero_stage=1"), "the deepspeed engine multiplies in the training precision",
     "set plan.engine=fsdp2"),
    (("cluster=local_cpu", "cluster.devices_per_node=2"), "cluster.accelerator=cpu only emulates them",
     "set plan.precision=bf16"),
    (("cluster=a100_8x", "cluster.nodes=1"), "cluster.device_fp8_tflops is not set",
     "set cluster.device_fp8_tflops to the GPU's dense FP8 rate"),
    # The FP8 rate is a multiple of the bf16 one: against the default (an A100's 312) an H100's 1979
    # would be 6.3x as fast, where it is 2x against its own 989.
    (("cluster=local_cpu", "cluster.accelerator=gpu", "cluster.device_fp8_tflops=1979"),
     "cluster.device_tflops is not set (its default is an A100's 312)",
     "set cluster.device_tflops to the GPU's dense bf16 rate"),
])
def test_fp8_where_it_cannot_run_is_refused_with_the_fix(overrides, message, fix):
    violation = _refusal(*H100, "plan.precision=fp8", *overrides)
    assert message in violation.message and violation.fix.startswith(fix)


def test_a_recipe_without_fp8_is_refused():
    violation = _refusal(*H100, "plan.precision=bf16", "plan.fp8_recipe=rowwise", field="plan.fp8_recipe")
    assert "plan.precision=bf16 runs none" in violation.message and violation.fix.startswith("set plan.precision=fp8")


def test_only_linear_layers_of_fp8_widths_count_and_a_weight_is_cast_once_per_micro_batch():
    linear = Gemm(batch=1, m=8, n=64, k=32, grows="m")  # 8 tokens by a 32 x 64 weight, forward
    wgrad = Gemm(batch=1, m=32, n=64, k=8, grows="k")  # the weight's gradient: a sum over tokens
    narrow = Gemm(batch=1, m=8, n=24, k=32, grows="m")  # 24 outputs: not a multiple of 16
    attention = Gemm(batch=4, m=8, n=8, k=16, grows="batch")
    model = ModelCost(seq_len=8, flops_per_sample=0, flops_per_sample_checkpointed=0, param_count=0,
                      tp_param_count={}, row_parallel_out_per_sample=0, row_parallel_layers=0,
                      column_parallel_in_per_sample=0, column_parallel_layers=0, boundary_per_sample=0, n_layers=1,
                      param_modules=1, gemms={1: ((linear, 2), (wgrad, 1), (narrow, 1), (attention, 1))})
    found = fp8_matmuls(model, 1, 2)
    assert found.flops == 2 * (2 * 16 * 64 * 32) + 2 * 32 * 64 * 16
    # Forward: the 16 tokens' activations and the weight, once; weight gradient: both grow with tokens.
    assert found.cast_elements == 2 * (16 * 32 + 32 * 64) + (32 * 16 + 16 * 64)
    head = ModelCost(**{**model.__dict__, "flops_outside_layers_per_sample": 2 * 8 * 64 * 32})
    assert fp8_matmuls(head, 1, 2).flops == pytest.approx(found.flops - 2 * 2 * 8 * 64 * 32)


def _step(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*H100, "plan.micro_batch_size=2", *overrides))
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    return estimate, declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)


def test_fp8_matmuls_are_faster_after_their_casts_and_change_no_memory():
    bf16_estimate, bf16 = _step("plan.precision=bf16")
    fp8_estimate, fp8 = _step("plan.precision=fp8")
    _, compiled_bf16 = _step("plan.precision=bf16", "plan.compile=true")
    _, compiled_fp8 = _step("plan.precision=fp8", "plan.compile=true")
    assert bf16.compute_s / 2 < fp8.compute_s < bf16.compute_s  # H100: 1979 / 989 TFLOP/s, for most matmuls
    assert fp8.memory_s > bf16.memory_s
    eager_casts, compiled_casts = fp8.memory_s - bf16.memory_s, compiled_fp8.memory_s - compiled_bf16.memory_s
    assert compiled_casts == pytest.approx(eager_casts * FP8_CAST_BYTES[True] / FP8_CAST_BYTES[False])
    assert fp8_estimate.per_device.total == bf16_estimate.per_device.total  # activations and states as bf16


def test_the_tuner_tries_fp8_beside_bf16_where_the_cluster_and_engine_have_it():
    from orch.tune.search import _space, prepare

    typed = _typed("cluster=h100_8x", "cluster.nodes=1", "plan.precision=bf16", "tune.engines=[deepspeed,fsdp2]",
                   "tune.zero_stages=[1]")
    assert list(typed.tune.fp8) == [False, True]
    plans = list(_space(typed, 8, True).plans())
    assert {p.precision for p in plans if p.engine == "fsdp2"} == {Precision.bf16, Precision.fp8}
    assert {p.precision for p in plans if p.engine == "deepspeed"} == {Precision.bf16}
    only = _typed("cluster=h100_8x", "plan.precision=bf16", "tune.engines=[fsdp2]", "tune.fp8=[true]")
    assert {p.precision for p in _space(only, 8, True).plans()} == {Precision.fp8}
    a100 = _typed("cluster=a100_8x", "cluster.nodes=1", "plan.precision=bf16", "tune.engines=[fsdp2]")
    space, _ = prepare(a100, to_typed(compose_config())[1], a100.cluster)
    assert space.fp8 == (False,)
    # An FP8 rate with no bf16 rate to set it against is not tried either (a plan that names fp8 is
    # refused, saying which rate is missing).
    unset = _typed("cluster.accelerator=gpu", "cluster.device_fp8_tflops=1979", "plan.precision=bf16",
                   "tune.engines=[fsdp2]")
    space, _ = prepare(unset, to_typed(compose_config())[1], unset.cluster)
    assert space.fp8 == (False,)


def _ranks(out, **kwargs) -> dict:
    from helpers.fsdp2_ranks import spawn

    out.mkdir()
    spawn("fp8", 2, out, free_port(), **kwargs)
    return json.loads((out / "fp8.json").read_text())


@pytest.mark.slow
def test_fp8_trains_as_bf16_does_with_float8_layers_in_the_blocks_and_the_same_checkpoint_keys(tmp_path):
    """On CPU, where torch runs its scaled matmul without FP8 tensor cores: the GPT at dp=2 in bf16
    and in fp8 (tensorwise), and the Llama at tp=2 in fp8 (rowwise)."""
    bf16 = _ranks(tmp_path / "bf16", model="gpt", precision="bf16")
    fp8 = _ranks(tmp_path / "fp8", model="gpt", precision="fp8")
    assert bf16["linear_kinds"] == ["Linear"] and fp8["linear_kinds"] == ["Float8Linear"]
    assert fp8["built"].endswith("8 linear layers multiplying in FP8 (tensorwise scaling)")  # 4 in each block
    assert fp8["keys"] == bf16["keys"]
    assert fp8["losses"] == pytest.approx(bf16["losses"], rel=5e-3)
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.3
    llama = _ranks(tmp_path / "llama", model="llama", precision="fp8", tp=2, recipe="rowwise")
    # q, k, v, o and the MLP's three in each block; the head stays in bf16, split over the vocabulary.
    assert llama["built"].endswith("14 linear layers multiplying in FP8 (rowwise scaling), the output head split "
                                   "over the vocabulary (loss parallel, lm_head)")
    assert llama["linear_kinds"] == ["Float8Linear", "Linear"]
    assert llama["losses"][-1] < llama["losses"][0] - 0.3
