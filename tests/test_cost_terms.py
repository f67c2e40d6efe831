"""The cost model's GPU terms, each pure and fast: memory-bound kernels counted on meta, NCCL's bus
bandwidth across nodes, the optimizer's passes, and what `orch tune` prices a plan's speed at."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.config import compose_config, gpu_plan, lm_inputs
from orch.config import to_typed
from orch.models import model_factory
from orch.plans.memory.estimate import ModelProbe
from orch.plans.spec import Accelerator, ClusterSpec, Offload, OptimizerName, OptimSpec, Precision, TrainSpec
from orch.plans.step_time.cost_model import (
    DECLARED_BUS_EFFICIENCY,
    DECLARED_MEMORY_EFFICIENCY,
    DECLARED_ZERO3_MODULE_S,
    Gemm,
    ModelCost,
    Speeds,
    StepTime,
    _optimizer_bytes_per_param,
    gemm_seconds,
    host_optimizer_s,
    matmul_efficiency,
    predict_step,
    tp_whole_flops,
    wave_efficiency,
)
from orch.plans.step_time.memory_traffic import EagerAndFused, MemoryTraffic, fused_attention
from orch.plans.step_time.model_cost import measure_model_cost
from orch.tune.result import TrainBudget, duration, duration_range, render
from orch.workloads.gpt import TP_LAYER_SPECS

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


def test_a_compiled_run_of_kernels_reads_its_inputs_and_writes_only_what_outlives_it():
    """Inside a compiled layer, norm -> GELU -> add fuse into one kernel: the intermediates never
    reach memory; the output, alive after the pass, is written; a matmul ends the fused run."""
    from torch.utils.module_tracker import ModuleTracker

    class Block(torch.nn.Module):
        def forward(self, x, w):
            y = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:])) + x
            return y @ w

    block, x = Block(), torch.empty(4, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    tensor = x.numel() * 2
    with ModuleTracker() as tracker, MemoryTraffic(tracker, frozenset({"Block"})) as eager:
        block(x, w)
    # layer_norm reads x and writes its output (and its mean and rstd), GELU and the add each read and write.
    assert eager.bytes >= 6 * tensor
    with ModuleTracker() as tracker, MemoryTraffic(tracker, frozenset({"Block"}), fused=True) as fused:
        out = block(x, w)
    # One kernel: x read once by the norm, again by the add (counted per read), y written for the matmul.
    assert fused.bytes == 2 * tensor + tensor and fused.kernels_fused_away == 2
    assert out.shape == (4, 256)
    # One pass counted both ways gives each count of a pass of its own (the model's cost counts so).
    with ModuleTracker() as tracker, EagerAndFused(tracker, frozenset({"Block"})) as both:
        block(x, w)
    assert (both.eager.bytes, both.fused.bytes, both.fused.kernels_fused_away) == (eager.bytes, fused.bytes, 2)


def _cost(**model) -> ModelCost:
    cfg = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 128,
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


def test_compiled_layers_move_fewer_bytes_in_fewer_kernels_and_the_step_is_priced_so():
    cost = _cost()
    assert 0 < cost.memory_bytes_per_sample_compiled < cost.memory_bytes_per_sample
    assert 0 < cost.memory_bytes_per_sample_checkpointed_compiled < cost.memory_bytes_per_sample_checkpointed
    assert 0 < cost.ops_fused_away_per_micro_batch < cost.ops_per_micro_batch
    speeds = Speeds.declared(A100)
    eager = predict_step(_plan(engine="fsdp2", zero_stage=0), cost, speeds, devices_per_node=8, optim=OptimSpec())
    compiled = predict_step(_plan(engine="fsdp2", zero_stage=0, compile=True), cost, speeds, devices_per_node=8,
                            optim=OptimSpec())
    ratio = cost.memory_bytes_per_sample_compiled / cost.memory_bytes_per_sample
    assert compiled.memory_s == pytest.approx(eager.memory_s * ratio, rel=0.01)
    assert compiled.total_s < eager.total_s
    launching = dataclasses.replace(speeds, op_overhead_s=1e-5)  # fewer kernels, fewer launches
    eager, compiled = (predict_step(_plan(engine="fsdp2", zero_stage=0, compile=c), cost, launching,
                                    devices_per_node=8, optim=OptimSpec()) for c in (False, True))
    assert eager.compute_s - compiled.compute_s == pytest.approx(cost.ops_fused_away_per_micro_batch * 1e-5)


def _plan(**kw):
    return gpu_plan(**({"dp": 32} | kw))


def test_an_fp32_plan_on_gpus_is_priced_at_the_fp32_matmul_rate_and_8_gib_gpus_are_said():
    """A GPU's defaults are an A100's: 312 TFLOP/s in bf16, but fp32 matmuls (TF32 off, torch's
    default) run at 19.5; a declared device_tflops is kept. A GPU declared over the CPU preset keeps
    its 8 GiB share of host memory per worker, which `orch check` and `orch train` say."""
    from orch.checking import declared_memory_notes
    from orch.plans.spec import Precision

    gpu = ClusterSpec(accelerator=Accelerator.gpu)
    rates = {p: Speeds.declared(gpu, p).tflops_at(1) for p in (Precision.bf16, Precision.fp32)}
    assert rates[Precision.fp32] == pytest.approx(rates[Precision.bf16] * 19.5 / 312)
    assert Speeds.declared(dataclasses.replace(gpu, device_tflops=60), Precision.fp32).tflops_at(1) == pytest.approx(
        Speeds.declared(dataclasses.replace(gpu, device_tflops=60), Precision.bf16).tflops_at(1))
    assert Speeds.declared(ClusterSpec(), Precision.fp32) == Speeds.declared(ClusterSpec(), Precision.bf16)
    [note] = declared_memory_notes(gpu)
    assert note.startswith("cluster.device_memory_gib=8 is the CPU preset's share") and "=80" in note
    assert declared_memory_notes(A100) == declared_memory_notes(ClusterSpec()) == []


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


def test_a_gemms_output_tiles_run_in_waves_over_the_sms():
    """2048 x 2304 in 128 x 256 tiles: 16 x 9 = 144 tiles, two waves on an A100's 108 SMs, the
    second one a third full; 128 x 128 tiles make 288, three waves of which the last is two-thirds full."""
    assert wave_efficiency(1, 2048, 2304, 108, (128, 256)) == pytest.approx(144 / 216)
    assert wave_efficiency(1, 2048, 2304, 108, (128, 128)) == pytest.approx(288 / 324)
    assert wave_efficiency(1, 8192, 8192, 108, (128, 128)) == pytest.approx(4096 / 4104)  # a big GEMM: whole waves
    # An edge tile counts whole: 2049 rows take a 17th row of tiles (17 x 6 = 102 of one wave's 108).
    assert wave_efficiency(1, 2049, 1536, 108, (128, 256)) == pytest.approx(102 / 108)


def test_a_thin_gemm_is_bound_by_memory_and_a_large_one_by_the_sustained_rate():
    rate, bandwidth = 312e12 * 0.8, 2039e9 * DECLARED_MEMORY_EFFICIENCY
    args = {"flops_per_s": rate, "bytes_per_s": bandwidth, "sm_count": 108, "element_bytes": 2,
            "tiles": ((128, 256), (256, 128), (128, 128))}
    # 8192^3: 4096 tiles of 128 x 128, 38 waves; 1.1 TFLOP against 400 MB.
    big = gemm_seconds(1, 8192, 8192, 8192, **args)
    assert big == pytest.approx(2 * 8192**3 / (rate * 4096 / 4104))
    # 16 rows (a decode-sized batch) by a 12288 x 12288 weight: reading the weight dominates.
    thin = gemm_seconds(1, 16, 12288, 12288, **args)
    weight_read = 2 * 12288 * 12288 / bandwidth
    assert thin >= weight_read > 2 * 16 * 12288 * 12288 / rate
    # Attention scores at head width 96: writing 2048 x 2048 per head costs more than its FLOPs.
    scores = gemm_seconds(24, 2048, 2048, 96, **args)
    assert scores == pytest.approx(2 * 24 * (2 * 2048 * 96 + 2048 * 2048) / bandwidth)


def test_matmul_efficiency_weighs_gemms_by_flops_and_leaves_cpus_at_their_measured_rate():
    speeds = Speeds.declared(A100)
    rate = speeds.tflops_at(1) * 1e12
    whole = ((Gemm(1, 8192, 8192, 8192), 1),)
    assert matmul_efficiency(whole, 1, speeds, flops_per_s=rate, element_bytes=2) == pytest.approx(4096 / 4104)
    # The rows a linear layer's input has grow with the micro-batch, and so do its tiles.
    linear = ((Gemm(1, 2048, 2304, 2304, grows="m"), 1),)
    at = {mb: matmul_efficiency(linear, mb, speeds, flops_per_s=rate, element_bytes=2) for mb in (1, 3)}
    assert at[1] == pytest.approx(288 / 324) and at[3] == pytest.approx(1.0)
    cpu = Speeds.declared(ClusterSpec())
    assert cpu.sm_count == 0
    assert matmul_efficiency(linear, 1, cpu, flops_per_s=cpu.tflops_at(1) * 1e12, element_bytes=4) == 1.0
    assert Speeds.declared(dataclasses.replace(A100, device_sm_count=132)).sm_count == 132


def test_gemms_are_recorded_per_tensor_parallel_shard_with_the_dimension_the_batch_grows():
    cost = _cost(fused_attention=False)
    ones = {tp: {g: c for g, c in gemms} for tp, gemms in cost.gemms.items()}
    # The MLP's first linear (64 -> 256 at width 64, 128 tokens): forward, and its two backward GEMMs.
    assert ones[1][Gemm(1, 128, 256, 64, grows="m")] >= 2
    assert Gemm(1, 128, 64, 256, grows="m") in ones[1]  # input gradient: tokens x in, reduced over out
    assert Gemm(1, 256, 64, 128, grows="k") in ones[1]  # weight gradient: reduced over the tokens
    # At tp=2 the column-parallel layer's output is half as wide; attention runs half the heads.
    assert Gemm(1, 128, 128, 64, grows="m") in ones[2]
    assert Gemm(4, 128, 128, 16, grows="batch") in ones[1] and Gemm(2, 128, 128, 16, grows="batch") in ones[2]
    # A 4-way shard's GEMMs, derived from the 2-way shard's (the dimensions that halved, quartered),
    # are what the 4-way shard itself runs.
    from orch.plans.step_time.model_cost import _divided, _gemm_pass, _shard_pass

    cfg = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 128,
           "vocab_size": 256, "tp": 1, "fused_attention": False}
    probe = ModelProbe(model_factory(cfg), lm_inputs(128), tp_layer_specs=TP_LAYER_SPECS)
    one = _gemm_pass(probe.module, probe.inputs, 1)
    assert _divided(one, _shard_pass(probe, probe.module, 2), 4) == _shard_pass(probe, probe.module, 4)
    flops = {tp: sum(2 * g.batch * g.m * g.n * g.k * c for g, c in gemms.items()) for tp, gemms in ones.items()}
    assert flops[1] <= cost.flops_per_sample  # the GEMMs are the counted FLOPs' matmuls
    assert flops[2] < flops[1]


def test_the_head_and_the_loss_run_on_the_last_stage_only():
    """The work outside the repeated layers is counted once, and a pipeline's last stage runs all of it."""
    costs = {n: _cost(n_layer=n) for n in (2, 4)}
    head = 6 * 128 * 64 * 256  # forward and backward of a 64 -> 256 head over 128 tokens
    assert costs[2].flops_outside_layers_per_sample == costs[4].flops_outside_layers_per_sample == head
    assert costs[2].memory_bytes_last_stage_per_sample == costs[4].memory_bytes_last_stage_per_sample > 0
    assert costs[4].memory_bytes_first_stage_per_sample > 0  # the embedding's lookup and its backward
    model = ModelCost(seq_len=2048, flops_per_sample=10**12, flops_per_sample_checkpointed=10**12,
                      param_count=10**9, tp_param_count={1: 10**9}, row_parallel_out_per_sample=0,
                      row_parallel_layers=0, column_parallel_in_per_sample=0, column_parallel_layers=0,
                      boundary_per_sample=0, n_layers=8, param_modules=10, flops_outside_layers_per_sample=2 * 10**11)
    speeds = Speeds.declared(A100)
    rate = speeds.tflops_at(2048) * 1e12
    one = predict_step(_plan(dp=1), model, speeds, devices_per_node=8, optim=OptimSpec())
    assert one.compute_s == pytest.approx(10**12 / rate)
    four = predict_step(_plan(dp=1, pp=4), model, speeds, devices_per_node=8, optim=OptimSpec())
    assert four.compute_s == pytest.approx((8 * 10**11 / 4 + 2 * 10**11) / rate)  # 2 layers and the head
    shared = dataclasses.replace(speeds, core_share=0.5)  # CPU workers on shared cores: half the surplus
    assert predict_step(_plan(dp=1, pp=4), model, shared, devices_per_node=8, optim=OptimSpec()).compute_s == (
        pytest.approx((10**12 / 4 + 0.5 * (2 * 10**11 - 2 * 10**11 / 4)) / rate))


def test_a_head_tensor_parallelism_leaves_whole_runs_whole_on_every_rank():
    """The built-in GPT's head is outside its tensor-parallel specs (AutoTP replicates it): at tp=2
    each rank runs all of the head's FLOPs, not half, on the last stage; a run whose software split
    every matmul (Megatron-LM's vocabulary-parallel head) is priced with it halved."""
    cost = _cost(n_layer=4)
    head = 6 * 128 * 64 * 256
    assert tp_whole_flops(cost, 1) == 0
    assert tp_whole_flops(cost, 2) == pytest.approx(head / 2)
    split = dataclasses.replace(cost, tp_splits_every_matmul=True)
    assert tp_whole_flops(split, 2) == 0
    speeds = Speeds.declared(A100)
    for pp in (1, 2):
        plan = _plan(dp=1, tp=2, pp=pp)
        whole, halved = (predict_step(plan, c, speeds, devices_per_node=8, optim=OptimSpec()) for c in (cost, split))
        mb = plan.micro_batch_size
        rate = speeds.tflops_at(mb * 128) * 1e12
        efficiency = matmul_efficiency(cost.gemms[2], mb, speeds, flops_per_s=rate,
                                       element_bytes=plan.precision.element_bytes)
        assert whole.compute_s - halved.compute_s == pytest.approx(
            plan.grad_accum_steps * mb * head / 2 / (rate * efficiency))


def test_the_optimizer_step_counts_deepspeeds_casts_and_the_clipping_norm():
    adam = OptimSpec()
    assert _optimizer_bytes_per_param(adam, Precision.fp32) == 28 + 4
    assert _optimizer_bytes_per_param(adam, Precision.bf16) == 28 + 4 + (2 + 4) * 2
    assert _optimizer_bytes_per_param(dataclasses.replace(adam, grad_clip=0.0), Precision.fp32) == 28


def test_an_offloaded_optimizer_steps_on_its_workers_threads_or_the_shared_host_memory():
    adam, part = OptimSpec(), 1e9
    one_cpu = Speeds.declared(A100)
    eight_cpus = Speeds.declared(dataclasses.replace(A100, cpus_per_worker=8))
    assert eight_cpus.host_optimizer_params_per_s == 8 * one_cpu.host_optimizer_params_per_s
    # One thread per worker: the thread bounds the step, not the node's 409 GB/s shared by 8.
    assert host_optimizer_s(part, adam, Precision.bf16, one_cpu, 8) == pytest.approx(
        part / one_cpu.host_optimizer_params_per_s)
    # Eight threads each: 8 workers' casts and updates at once saturate the node's memory.
    shared = part * _optimizer_bytes_per_param(adam, Precision.bf16) / (409e9 / 8)
    assert host_optimizer_s(part, adam, Precision.bf16, eight_cpus, 8) == pytest.approx(shared)
    # SGD without momentum moves 12 of Adam's 28 bytes per parameter.
    sgd = OptimSpec(name=OptimizerName.sgd)
    assert host_optimizer_s(part, sgd, Precision.bf16, one_cpu, 8) == pytest.approx(
        part * 12 / 28 / one_cpu.host_optimizer_params_per_s)
    # Speeds stored before the rate existed keep the bandwidth bound alone.
    unknown = dataclasses.replace(one_cpu, host_optimizer_params_per_s=0.0)
    assert host_optimizer_s(part, adam, Precision.bf16, unknown, 8) == pytest.approx(shared)
    # The step time carries it: one CPU per worker makes an offloaded step slower than eight.
    plan = _plan(dp=8, tp=1, pp=1, zero_stage=1, offload_optimizer=Offload.cpu)
    cost = _cost(n_layer=4)
    slow, fast = (predict_step(plan, cost, s, devices_per_node=8, optim=adam) for s in (one_cpu, eight_cpus))
    assert slow.optimizer_s > fast.optimizer_s and slow.total_s > fast.total_s


def test_deepspeed_zero3_pays_its_hooks_per_module_and_fetch_even_without_peers():
    from orch.plans.engines import engine_spec
    from orch.plans.spec import FSDPSpec

    def predict(plan, *args, **kw):
        return engine_spec(plan.engine).step_time(plan, *args, **kw)

    cost, speeds, adam = _cost(n_layer=4), Speeds.declared(A100), OptimSpec()

    def step(**kw):
        return predict(_plan(**({"dp": 1} | kw)), cost, speeds, devices_per_node=8, optim=adam)

    per_fetch = cost.param_modules * DECLARED_ZERO3_MODULE_S["gpu"]
    assert step(zero_stage=3, grad_accum_steps=2).zero3_hooks_s == pytest.approx(2 * 2 * per_fetch)
    # The recomputed forward fetches every module again.
    assert step(zero_stage=3, activation_checkpointing=True).zero3_hooks_s == pytest.approx(3 * per_fetch)
    assert step(zero_stage=2).zero3_hooks_s == 0
    # FSDP2 gathers one unit per block, priced as collectives (orch/plans/engines/fsdp2_time.py), with no such hooks.
    fsdp2 = step(zero_stage=3, engine="fsdp2", fsdp=FSDPSpec())
    assert fsdp2.zero3_hooks_s == 0
    three = step(zero_stage=3)
    assert three.total_s == pytest.approx(step(zero_stage=2).total_s + three.zero3_hooks_s, rel=0.05)
    assert three.as_dict()["parts_s"]["zero3_hooks"] == three.zero3_hooks_s


def test_gathers_and_reduce_scatters_are_priced_at_their_own_rates_and_all_reduces_at_theirs():
    """ZeRO-3 fetches parameters with all-gathers and reduces gradients with reduce-scatters;
    sequence parallelism turns each tensor-parallel all-reduce into a reduce-scatter and an
    all-gather: each at the rate calibration measured for it. Plain all-reduces keep theirs."""
    cost, adam = _cost(n_layer=4), OptimSpec()
    declared = dataclasses.replace(Speeds.declared(A100), intra_latency_s=0.0, inter_latency_s=0.0)
    slow = dataclasses.replace(declared, intra_all_gather_share=0.5, intra_reduce_scatter_share=0.25,
                               inter_all_gather_share=0.5, inter_reduce_scatter_share=0.25)

    def step(speeds, **kw):
        return predict_step(_plan(**kw), cost, speeds, devices_per_node=8, optim=adam)

    zero3 = dict(dp=8, zero_stage=3)
    fast, gathered = step(declared, **zero3).dp_comm_s, step(slow, **zero3).dp_comm_s
    # Two fetches (forward, backward) and a reduce-scatter, each half a ring's traffic.
    assert gathered == pytest.approx(fast * (2 / 0.5 + 1 / 0.25) / 3)
    assert step(slow, dp=8, zero_stage=0).dp_comm_s == step(declared, dp=8, zero_stage=0).dp_comm_s
    tp = dict(dp=1, tp=8, zero_stage=1)
    plain = step(slow, **tp).tp_comm_s
    assert plain == step(declared, **tp).tp_comm_s
    assert step(declared, sequence_parallel=True, **tp).tp_comm_s == pytest.approx(plain)
    assert step(slow, sequence_parallel=True, **tp).tp_comm_s == pytest.approx(plain * (1 / 0.5 + 1 / 0.25) / 2)


def test_attention_runs_at_its_own_share_of_the_matmul_rate():
    """The GPT's attention FLOPs are counted per call as the FLOP counter counts them (causal, its
    shape recorded for the calibration), and a share of 0.5 doubles their time alone: the compute
    part grows by one more pass of them at the matmul rate, recomputed ones included; the counted
    FLOPs the rates report stay as counted."""
    cost = _cost()
    per_layer_forward = 4 * 4 * 128 * 128 * 16  # 4 heads x (q k^T, p v) of 2 x 128 x 128 x 16 each
    assert cost.attention_forward_flops_per_sample == 2 * per_layer_forward
    assert cost.attention_shape == (4, 128, 128, 16, 1)
    speeds = Speeds.declared(A100)
    halved = dataclasses.replace(speeds, attention_share=0.5)
    for recompute, passes in ((False, 3), ("full", 4), ("selective", 3)):
        plan = _plan(engine="fsdp2", zero_stage=0, dp=1, micro_batch_size=4, grad_accum_steps=2,
                     activation_checkpointing=recompute)
        assert cost.attention_flops_of(plan) == passes * cost.attention_forward_flops_per_sample
        as_matmuls, own_rate = (predict_step(plan, cost, s, devices_per_node=8, optim=OptimSpec())
                                for s in (speeds, halved))
        extra = cost.attention_flops_of(plan) * 4 * 2  # a second pass's worth, over the step's 8 samples
        rate = speeds.tflops_at(4 * 128) * 1e12 * matmul_efficiency(cost.gemms[1], 4, speeds,
                                                                     flops_per_s=speeds.tflops_at(4 * 128) * 1e12,
                                                                     element_bytes=2)
        assert own_rate.compute_s - as_matmuls.compute_s == pytest.approx(extra / rate, rel=1e-6)
        assert own_rate.tflops_per_device * own_rate.total_s == pytest.approx(
            as_matmuls.tflops_per_device * as_matmuls.total_s)


def test_calibration_times_attention_against_the_matmuls_at_the_same_rows():
    from orch.launchers.calibration import _attention_share

    share = _attention_share((2, 64, 64, 16, 1), [128], [0.05], torch.float32, torch.device("cpu"), 0.05)
    assert 0 < share < 100


def test_calibration_times_adam_on_the_host_threads():
    from orch.launchers.calibration import _host_adam_params_per_s

    rate = _host_adam_params_per_s(0.05, numel=1024 * 1024)
    assert 1e6 < rate < 1e11


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
    # A workload without tokens (images) counts samples, and says so.
    images = TrainBudget.declared(TrainSpec(steps=100), A100, 512, None)
    assert (images.tokens, images.unit, images.source) == (100 * 512, "samples", "train.steps 100 x global batch 512")
    assert steps.unit == "tokens" and "x sequence 2048" in steps.source
    assert [duration(s) for s in (30, 600, 7200 * 2, 86400 * 10)] == ["30 s", "10 min", "4 h", "10.0 d"]
    # A range says its unit once where both ends read best in it.
    assert [duration_range(*pair) for pair in ((75, 80.6), (110, 130), (3 * 86400, 4.2 * 86400))] == [
        "75-80.6 s", "110 s-2.17 min", "3.0-4.2 d"]


def test_orch_tune_prints_mfu_time_to_train_and_cost(tmp_path):
    from orch.tune.search import tune

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
    # Declared GPU speeds: the time and the cost carry the published runs' P10-P90 of measured / predicted.
    ratios = result.ratio_range()
    assert ratios.known and ratios.cases == 11
    seconds = 1e9 / best.tokens_per_s
    assert (f"in {duration(seconds)} (P10-P90 {duration_range(ratios.p10 * seconds, ratios.p90 * seconds)}) for "
            in table)
    assert f"  range: {ratios.source}" in table
    doc = result.as_json(top_k=3)
    assert doc["budget"]["tokens"] == 10**9
    assert doc["candidates"][0]["predicted"]["cost_usd"] == pytest.approx(hours * 2 * 3)
    assert doc["range_ratio"] == ratios.as_json()
    spread = doc["best"]["predicted"]["range"]
    for key, value in (("step_time_s", best.total_s), ("time_to_train_s", seconds), ("cost_usd", hours * 2 * 3)):
        assert spread[key] == {"p10": pytest.approx(ratios.p10 * value), "p90": pytest.approx(ratios.p90 * value)}
    # The default plan is fp32: its MFU is against the GPU's fp32 peak (19.5), not bf16's 312.
    assert doc["candidates"][0]["predicted"]["mfu"] == pytest.approx(best.model_tflops_per_device / 19.5)
    unpriced, _, _ = to_typed(compose_config(f"tune.out={tmp_path / 'u.yaml'}", "train.global_batch_size=16",
                                             "tune.pp=[1]", "tune.tp=[1]", "tune.zero_stages=[0]",
                                             "tune.offload=[none]"))
    cpu = tune(unpriced, model_cfg)
    table = render(cpu, top_k=3)
    assert "set cluster.device_hour_usd to price it" in table and " cost" not in table.splitlines()[4]
    # Declared CPU speeds: no case measured their error, so the time has no range, and the reason is said.
    assert "P10-P90" not in table and "  no range: the cost model's error at declared speeds" in table
    doc = cpu.as_json(top_k=3)
    assert doc["range_ratio"]["p10"] is None and doc["best"]["predicted"]["range"] is None
    # Speeds calibrated on CPU workers (as trials measure them): the stored CPU grids' error gives the range.
    cpu.speeds = dataclasses.replace(cpu.speeds, source="measured")
    table = render(cpu, top_k=3)
    assert "(P10-P90 " in table and f"  range: {cpu.ratio_range().source}" in table
    assert "calibrated CPU trials' measured/predicted step time, bench/tuner_accuracy.py" in table
    assert cpu.as_json(top_k=3)["best"]["predicted"]["range"]["cost_usd"] is None  # unpriced


def test_the_gpts_unfused_attention_computes_what_the_fused_one_does():
    """``model.fused_attention=false`` changes the kernels (and what they cost), not the model."""
    from orch.workloads.gpt import GPT

    torch.manual_seed(0)
    fused = GPT(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    unfused = GPT(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64, fused_attention=False)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(unfused(ids), fused(ids), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"model.dropout\(1.0\) must be in \[0, 1\)"):
        GPT(dropout=1.0)


def test_gpt_neox_20b_is_counted_as_its_own_code_counted_it():
    """The published 117 TFLOP/s of GPT-NeoX-20B came from its 2022 count, 6 N + 60 s h l per token,
    with N its published 20,554,567,680 parameters; Megatron-LM's formula would make its step 9% longer."""
    from bench.megatron_sanity import NEOX, megatron_flops, neox_2022_flops, neox_parameters, run_flops

    assert neox_parameters(NEOX) == 20_554_567_680
    assert run_flops(NEOX) == neox_2022_flops(NEOX) == NEOX.batch * 2048 * (6 * 20_554_567_680 + 60 * 2048 * 6144 * 44)
    assert 1.08 < megatron_flops(NEOX) / run_flops(NEOX) < 1.10
