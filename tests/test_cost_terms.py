"""The cost model's GPU terms, each pure and fast: memory-bound kernels counted on meta, NCCL's bus
bandwidth across nodes, the optimizer's passes, and what `orch tune` prices a plan's speed at."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.config import compose_config, gpu_plan, lm_inputs
from orchestrator.config import to_typed
from orchestrator.models import model_factory
from orchestrator.tune_result import TrainBudget, duration, render
from plans.cost_model import (
    DECLARED_BUS_EFFICIENCY,
    DECLARED_MEMORY_EFFICIENCY,
    ModelCost,
    Speeds,
    StepTime,
    _optimizer_bytes_per_param,
    predict_step,
)
from plans.estimate import ModelProbe
from plans.memory_traffic import MemoryTraffic, fused_attention
from plans.model_cost import measure_model_cost
from plans.spec import Accelerator, ClusterSpec, OptimSpec, Precision, TrainSpec
from workloads.gpt import TP_LAYER_SPECS

A100 = ClusterSpec(nodes=4, devices_per_node=8, accelerator=Accelerator.gpu, device_memory_gib=80,
                   device_tflops=312, intra_node_gbps=2400, inter_node_gbps=200, device_memory_gb_per_s=2039)


def test_memory_traffic_counts_what_each_kernel_reads_and_writes():
    x = torch.empty(4, 1024, dtype=torch.bfloat16, device="meta")
    with MemoryTraffic() as traffic:
        torch.nn.functional.gelu(x)  # reads x, writes its result
        x.view(1024, 4).t()  # views move nothing
        x @ torch.empty(1024, 8, dtype=torch.bfloat16, device="meta")  # a matmul is priced by its FLOPs
    assert traffic.bytes == 2 * x.numel() * 2
    table = torch.empty(50_000, 64, device="meta")
    ids = torch.zeros(8, dtype=torch.long, device="meta")
    with MemoryTraffic() as traffic:
        torch.nn.functional.embedding(ids, table)  # a gather reads the rows it picks, not the table
    assert traffic.bytes == 8 * 64 * 4 + 8 * 8


def _cost(**model) -> ModelCost:
    cfg = {"_target_": "workloads.gpt.GPT", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 128,
           "vocab_size": 256, "tp": 1, **model}
    probe = ModelProbe(model_factory(cfg), lm_inputs(cfg["seq_len"]), tp_layer_specs=TP_LAYER_SPECS)
    return measure_model_cost(probe, [1, 2])


def test_fused_attention_writes_no_sequence_by_sequence_scores():
    """Per token, the fused kernels' traffic does not grow with the sequence; written-out scores do."""
    per_token = {(fused, seq): _cost(seq_len=seq, fused_attention=fused).memory_bytes_per_sample / seq
                 for fused in (True, False) for seq in (64, 256)}
    assert per_token[True, 256] == pytest.approx(per_token[True, 64], rel=0.05)
    scores = {seq: per_token[False, seq] - per_token[True, seq] for seq in (64, 256)}
    assert scores[256] > 2 * scores[64]  # heads x sequence per token, over a part that is not
    assert fused_attention  # the context the counting runs in, also used by callers


def test_tensor_parallelism_divides_only_the_kernels_between_its_layers():
    cost = _cost()
    assert 0 < cost.memory_bytes_sharded_per_sample < cost.memory_bytes_per_sample
    assert cost.memory_bytes_per_sample_checkpointed > cost.memory_bytes_per_sample  # the forward again


def _plan(**kw):
    return gpu_plan(**({"dp": 32} | kw))


def test_declared_gpu_speeds_are_derated_to_what_kernels_and_nccl_reach():
    s = Speeds.declared(A100)
    assert s.sustained_memory_gb_per_s == pytest.approx(2039 * DECLARED_MEMORY_EFFICIENCY)
    assert s.bus_gbps("intra") == pytest.approx(2400 * DECLARED_BUS_EFFICIENCY["intra"])
    # One rank per node: one adapter; 8 ranks per node: 8 adapters, capped by NVLink.
    assert s.bus_gbps("inter", 1) == pytest.approx(200 * DECLARED_BUS_EFFICIENCY["inter"])
    assert s.bus_gbps("inter", 8) == pytest.approx(min(8 * 200 * 0.93, 2400 * 0.78))
    cpu = Speeds.declared(ClusterSpec())
    assert cpu.memory_efficiency == cpu.intra_bus_efficiency == 1.0


def test_a_data_parallel_ring_with_all_of_a_nodes_devices_uses_all_its_adapters():
    """dp=32 over 4 nodes moves 8 adapters' worth across nodes; dp=4 at tp=8 one each."""
    model = ModelCost(seq_len=2048, flops_per_sample=10**12, flops_per_sample_checkpointed=10**12,
                      param_count=10**9, tp_param_count={1: 10**9, 8: 10**9 // 8}, row_parallel_out_per_sample=0,
                      row_parallel_layers=0, column_parallel_in_per_sample=0, column_parallel_layers=0,
                      boundary_per_sample=0, n_layers=8, param_modules=10)
    speeds = Speeds.declared(A100)
    step = predict_step(_plan(), model, speeds, devices_per_node=8, optim=OptimSpec())
    grads = 10**9 * 2
    assert step.dp_comm_s == pytest.approx(2 * 31 / 32 * grads / (speeds.bus_gbps("inter", 8) * 1e9 / 8)
                                           + 2 * 31 * speeds.inter_latency_s)


def test_pipeline_transfers_are_split_over_the_tensor_parallel_ranks_and_gathered():
    """DeepSpeed's pipeline engine (pipe_partitioned / grad_partitioned) sends 1/tp of a boundary
    from each tensor-parallel rank and all-gathers it on the receiving stage, forward and back."""
    boundary = 2048 * 8192  # one sample's hidden states at sequence 2048, width 8192
    model = ModelCost(seq_len=2048, flops_per_sample=10**12, flops_per_sample_checkpointed=10**12,
                      param_count=10**9, tp_param_count={1: 10**9, 8: 10**9 // 8}, row_parallel_out_per_sample=0,
                      row_parallel_layers=0, column_parallel_in_per_sample=0, column_parallel_layers=0,
                      boundary_per_sample=boundary, n_layers=8, param_modules=10)
    speeds = Speeds.declared(A100)
    nbytes = boundary * 2  # bf16, micro-batch 1
    inter, intra = speeds.bus_gbps("inter") * 1e9 / 8, speeds.bus_gbps("intra") * 1e9 / 8
    # tp=1: the four stages share a node and each sends the whole boundary over NVLink.
    whole = predict_step(_plan(dp=1, pp=4), model, speeds, devices_per_node=8, optim=OptimSpec())
    assert whole.pp_comm_s == pytest.approx(2 * (nbytes / intra + speeds.intra_latency_s))
    # tp=8: a stage per node; each rank sends an eighth across nodes, the next stage gathers it.
    split = predict_step(_plan(dp=1, tp=8, pp=4), model, speeds, devices_per_node=8, optim=OptimSpec())
    gather = 7 / 8 * nbytes / intra + 7 * speeds.intra_latency_s
    assert split.pp_comm_s == pytest.approx(2 * (nbytes / 8 / inter + speeds.inter_latency_s + gather))


def test_the_optimizer_step_counts_deepspeeds_casts_and_the_clipping_norm():
    adam = OptimSpec()
    assert _optimizer_bytes_per_param(adam, Precision.fp32) == 28 + 4
    assert _optimizer_bytes_per_param(adam, Precision.bf16) == 28 + 4 + (2 + 4) * 2
    assert _optimizer_bytes_per_param(dataclasses.replace(adam, grad_clip=0.0), Precision.fp32) == 28


def _step(total_s: float = 2.0, tokens_per_s: float = 1e6, model_tflops: float = 156.0) -> StepTime:
    return StepTime(compute_s=total_s, memory_s=0, bubble_s=0, tp_comm_s=0, dp_comm_s=0, pp_comm_s=0, offload_s=0,
                    optimizer_s=0, tokens_per_s=tokens_per_s, tflops_per_device=model_tflops,
                    model_tflops_per_device=model_tflops)


def test_time_to_train_cost_and_mfu_follow_from_the_predicted_speed():
    cluster = dataclasses.replace(A100, device_hour_usd=2.0)
    budget = TrainBudget.declared(TrainSpec(tokens=36 * 10**8), cluster, 512, 2048)
    step = _step()
    assert budget.time_s(step) == pytest.approx(3600)
    assert budget.cost_usd(step) == pytest.approx(32 * 2.0)
    assert budget.mfu(step) == pytest.approx(0.5)
    steps = TrainBudget.declared(TrainSpec(steps=100), A100, 512, 2048)
    assert steps.tokens == 100 * 512 * 2048 and "train.steps 100" in steps.source
    assert steps.cost_usd(step) is None
    assert TrainBudget.declared(TrainSpec(), ClusterSpec(), 16, 128).mfu(step) is None  # no peak on CPU
    assert [duration(s) for s in (30, 600, 7200 * 2, 86400 * 10)] == ["30 s", "10 min", "4 h", "10.0 d"]


def test_orch_tune_prints_mfu_time_to_train_and_cost(tmp_path):
    from orchestrator.tuning import tune

    typed, model_cfg, _ = to_typed(compose_config(
        f"tune.out={tmp_path / 'w.yaml'}", "train.global_batch_size=16", "tune.pp=[1]", "tune.tp=[1]",
        "tune.zero_stages=[0]", "tune.offload=[none]", "cluster.accelerator=gpu", "cluster.device_hour_usd=3",
        "train.tokens=1000000000"))
    result = tune(typed, model_cfg)
    table = render(result, top_k=3)
    assert "time to train 1,000,000,000 tokens (train.tokens) on 2 devices at $3 per device-hour" in table
    header = next(line for line in table.splitlines() if line.lstrip().startswith("#"))
    assert all(name in header for name in ("TFLOP/s", "MFU", "to train", "cost"))
    best = result.search.ranked[0].predicted
    hours = 1e9 / best.tokens_per_s / 3600
    assert f"for ${hours * 2 * 3:,.2f}" in table or f"for ${hours * 2 * 3:,.0f}" in table
    doc = result.as_json(top_k=3)
    assert doc["budget"]["tokens"] == 10**9
    assert doc["candidates"][0]["predicted"]["cost_usd"] == pytest.approx(hours * 2 * 3)
    assert doc["candidates"][0]["predicted"]["mfu"] == pytest.approx(best.model_tflops_per_device / 312)
    unpriced, _, _ = to_typed(compose_config(f"tune.out={tmp_path / 'u.yaml'}", "train.global_batch_size=16",
                                             "tune.pp=[1]", "tune.tp=[1]", "tune.zero_stages=[0]",
                                             "tune.offload=[none]"))
    table = render(tune(unpriced, model_cfg), top_k=3)
    assert "set cluster.device_hour_usd to price it" in table and " cost" not in table.splitlines()[4]


def test_the_gpts_unfused_attention_computes_what_the_fused_one_does():
    """``model.fused_attention=false`` changes the kernels (and what they cost), not the model."""
    from workloads.gpt import GPT

    torch.manual_seed(0)
    fused = GPT(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    unfused = GPT(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64, fused_attention=False)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(unfused(ids), fused(ids), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"model.dropout\(1.0\) must be in \[0, 1\)"):
        GPT(dropout=1.0)


@pytest.mark.slow
def test_published_megatron_runs_are_predicted_within_fifteen_percent():
    """Two rows of bench/megatron_sanity.py (the whole table takes minutes): one without tensor
    parallelism, where the memory-bound kernels weigh most, and one at tp=8."""
    from bench.megatron_sanity import TABLE_1, predict

    for run in (TABLE_1[0], TABLE_1[3]):
        assert abs(predict(run)["error"]) <= 0.15, run.name
