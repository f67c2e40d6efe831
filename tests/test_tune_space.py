"""The tuner's pure core: enumeration, pruning, the cost model, and the 175B search speed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from helpers.config import compose_config, gpu_plan, lm_inputs
from helpers.orch_command import orch_run
from orch.config import to_typed
from orch.launchers.placement import rank_layout
from orch.models import model_factory
from orch.plans.memory.activations import measure_activations
from orch.plans.resolve import ResolvedPlan, resolve_plan
from orch.plans.search.space import BatchScaledProbe, SearchSpace, plan_spec, search, structural_rejection
from orch.plans.spec import Accelerator, ClusterSpec, Offload, OptimSpec, PlanSpec, Precision
from orch.plans.step_time.cost_model import ModelCost, Speeds, group_links, predict_step
from orch.plans.step_time.flops import training_flops_per_sample
from orch.plans.step_time.model_cost import measure_model_cost
from orch.tune.plan_file import plan_overrides, write_plan_file
from orch.tune.search import declared_global_batch, global_batch_origin, prepare
from orch.workloads.gpt import TP_LAYER_SPECS

SMALL = {"_target_": "orch.workloads.gpt.GPT", "n_layer": 2, "d_model": 128, "n_head": 4, "seq_len": 128,
         "vocab_size": 256, "tp": 1}


def _plan(**kw):
    return gpu_plan(**({"grad_accum_steps": 8} | kw))


def _model(**kw) -> ModelCost:
    base = dict(seq_len=2048, flops_per_sample=10**15, flops_per_sample_checkpointed=13 * 10**14,
                param_count=10**10, tp_param_count={1: 10**10, 2: 5 * 10**9, 4: 25 * 10**8, 8: 125 * 10**7},
                row_parallel_out_per_sample=10**8, row_parallel_layers=64, column_parallel_in_per_sample=10**8,
                column_parallel_layers=64, boundary_per_sample=10**7, n_layers=32, param_modules=200)
    base.update(kw)
    return ModelCost(**base)


A100 = ClusterSpec(nodes=4, devices_per_node=8, accelerator=Accelerator.gpu, device_memory_gib=80,
                   host_memory_gib=1024, device_tflops=312, intra_node_gbps=2400, inter_node_gbps=200,
                   host_link_gbps=256, device_memory_gb_per_s=2039, host_memory_gb_per_s=409)
SPEEDS = Speeds.declared(A100)
ADAM = OptimSpec()


def _step(plan: ResolvedPlan, model: ModelCost | None = None, speeds: Speeds = SPEEDS, dpn: int = 8):
    return predict_step(plan, model or _model(), speeds, devices_per_node=dpn, optim=ADAM)


# --- enumeration ---------------------------------------------------------------------------------

def test_enumeration_covers_every_factorization_and_reaches_the_global_batch():
    space = SearchSpace(world_size=8, global_batch_size=32, zero_stages=(0, 1, 2, 3))
    plans = list(space.plans())
    assert {(p.dp, p.tp, p.pp) for p in plans} == {(8 // (t * q), t, q) for t in (1, 2, 4, 8) for q in (1, 2, 4, 8)
                                                    if 8 % (t * q) == 0}
    for p in plans:
        assert p.dp * p.tp * p.pp == 8
        assert p.micro_batch_size * p.grad_accum_steps * p.dp == 32
        assert p.micro_batch_size & (p.micro_batch_size - 1) == 0  # a power of two
        # only combinations ZeRO can express
        assert p.offload_param == Offload.none or p.zero_stage == 3
        assert p.offload_optimizer == Offload.none or p.zero_stage >= 1
    # dp=8: 32/8 = 4 samples per replica -> micro 1, 2, 4; 9 ZeRO/offload pairs; 2 checkpointing.
    assert sum(1 for p in plans if p.dp == 8) == 3 * 9 * 3
    assert len(plans) == len({dataclasses.astuple(p) for p in plans})


def test_the_batch_every_plan_is_priced_at_says_where_it_comes_from():
    """Left to the declared plan, the batch grows with the cluster; `orch tune` says so, and how
    to hold another."""
    cfg, _, _ = to_typed(compose_config("plan.micro_batch_size=8", "plan.grad_accum_steps=2"))
    assert declared_global_batch(cfg, world_size=2048) == 8 * 2 * 2048
    assert global_batch_origin(cfg, world_size=2048) == (
        "the declared plan's micro-batch 8 x accumulation 2 x dp 2048; train.global_batch_size sets it")
    held, _, _ = to_typed(compose_config("train.global_batch_size=1024"))
    assert declared_global_batch(held, world_size=2048) == 1024
    assert global_batch_origin(held, world_size=2048) == "train.global_batch_size"


def test_enumeration_honours_the_restricted_space():
    space = SearchSpace(world_size=4, global_batch_size=8, tp=(1,), pp=(1,), zero_stages=(2,),
                        offload=(Offload.none,), activation_checkpointing=(True,), micro_batch_sizes=(2, 4, 8))
    assert [(p.micro_batch_size, p.grad_accum_steps) for p in space.plans()] == [(2, 1)]  # 4, 8 exceed 8/4


def test_structural_rules_name_their_reason():
    def reject(**kw):
        return structural_rejection(PlanSpec(**kw), devices_per_node=8, n_layers=4,
                                    tp_problem=lambda tp: "tp does not divide model.n_head" if tp == 4 else None)

    assert reject(tp=3) and "devices_per_node" in reject(tp=3)
    assert reject(tp=4) == "tp does not divide model.n_head"
    assert "ZeRO-3 with tp > 1" in reject(tp=2, zero_stage=3)
    assert reject(pp=8) == "pp exceeds the model's layers"
    assert "ZeRO-2 with pp > 1" in reject(pp=2, zero_stage=2)
    assert reject(pp=2, zero_stage=1, offload_param=Offload.cpu) == "parameter offload with pp > 1"
    assert reject(tp=2, pp=2, zero_stage=1) is None


def test_search_prunes_and_counts_every_plan_once():
    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=16"))
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    result = search(space, ctx)
    assert result.enumerated == len(list(space.plans()))
    assert result.enumerated == len(result.ranked) + sum(result.rejected.values())
    assert "ZeRO-3 with tp > 1 (AutoTP trains with ZeRO 0, 1, 2)" in result.rejected
    ranked = [c.predicted.total_s for c in result.ranked]
    assert ranked == sorted(ranked)
    for c in result.ranked[:20]:
        # What the tuner ranks is what `orch train` accepts: the same resolve and the same estimate.
        assert resolve_plan(plan_spec(c.plan), typed.cluster, dataclasses.replace(typed.train)) == c.plan
        assert c.feasible and c.plan.global_batch_size == 16


def test_memory_prunes_plans_that_do_not_fit():
    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=64", "cluster.device_memory_gib=0.03",
                                                  "tune.tp=[1]", "tune.pp=[1]"))
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    result = search(space, ctx)
    assert result.rejected["does not fit: cluster.device_memory_gib"] == len(result.infeasible) > 0
    assert all(c.estimate.per_device.total <= 0.03 * 1024**3 for c in result.ranked)
    assert max(c.plan.micro_batch_size for c in result.infeasible) > max(c.plan.micro_batch_size for c in result.ranked)


def test_winner_file_is_a_valid_plan_and_overrides_round_trip(tmp_path):
    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=16", f"tune.out={tmp_path}/p.yaml"))
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    from orch.tune.result import TuneResult

    result = TuneResult(search=search(space, ctx), speeds=ctx.speeds, speeds_note="declared", global_batch_size=16)
    result.winner = result.search.best
    path = write_plan_file(result.winner.plan, typed, model_cfg, typed.cluster, result)
    # The file composes as a plan group option, and so do the printed overrides.
    from omegaconf import OmegaConf

    loaded = OmegaConf.merge(OmegaConf.structured(PlanSpec), {k: v for k, v in OmegaConf.load(path).items()
                                                              if k != "defaults"})
    assert OmegaConf.to_object(loaded) == plan_spec(result.winner.plan)
    again, _, _ = to_typed(compose_config(*plan_overrides(result.winner.plan, typed), "train.global_batch_size=16"))
    assert resolve_plan(again.plan, again.cluster, again.train) == result.winner.plan


# --- cost model ----------------------------------------------------------------------------------

def test_group_links_follow_the_launch_layout():
    for world, dpn, tp, pp in [(16, 8, 2, 2), (16, 4, 4, 1), (32, 8, 1, 4), (8, 8, 2, 4), (64, 8, 8, 2)]:
        layout = rank_layout(world, dpn, tp, pp)
        links = group_links(world, dpn, tp, pp)

        def crosses(key_fields, layout=layout):
            groups = {}
            for slot in layout:
                groups.setdefault(tuple(slot[k] for k in key_fields), set()).add(slot["node"])
            return "inter" if any(len(nodes) > 1 for nodes in groups.values()) else "intra"

        assert links.tp == crosses(("dp_rank", "pp_rank"))
        assert links.pp == crosses(("dp_rank", "tp_rank"))
        assert links.dp == crosses(("pp_rank", "tp_rank"))


def test_bubble_is_pp_minus_one_over_micro_batches():
    # A stage waits whole micro-batch times in the fill and drain: compute, memory-bound kernels,
    # all-reduces and the blocking point-to-point transfers alike.
    for pp, m in [(2, 4), (4, 8), (8, 64)]:
        t = _step(_plan(dp=1, pp=pp, grad_accum_steps=m))
        per_micro = t.compute_s + t.memory_s + t.tp_comm_s + t.pp_comm_s
        assert t.bubble_s / per_micro == pytest.approx((pp - 1) / m)
    assert _step(_plan()).bubble_s == 0


def test_workers_sharing_cores_lose_less_to_the_bubble():
    from orch.plans.step_time.cost_model import bubble_micro_batches

    # Devices of their own: pp - 1 micro-batch times, whatever the layout.
    assert [bubble_micro_batches(pp, 1.0) for pp in (1, 2, 4, 8)] == [0, 1, 3, 7]
    # 4 workers on 2 cores, pp=2: the waiting stage's core goes to the busy one, nothing idles.
    assert bubble_micro_batches(2, 0.5) == 0
    # pp=4 on half a core each: a core idles only while one stage of four computes (k=1), in the
    # fill and the drain, a quarter of the cores for half a micro-batch time each.
    assert bubble_micro_batches(4, 0.5) == pytest.approx(0.5)
    plan = _plan(dp=1, pp=4, grad_accum_steps=8)
    shared = _step(plan, speeds=dataclasses.replace(SPEEDS, core_share=0.5))
    per_micro = shared.compute_s + shared.memory_s + shared.tp_comm_s + shared.pp_comm_s
    assert shared.bubble_s / per_micro == pytest.approx(0.5 / 8)


def test_cost_model_monotonicity():
    base = _step(_plan())
    # Recomputation costs compute.
    assert _step(_plan(activation_checkpointing=True)).compute_s > base.compute_s
    # A slower inter-node network slows dp replicas that span nodes, not those inside one node.
    slow = dataclasses.replace(SPEEDS, inter_node_gbps=50)
    spanning = _plan(dp=32)
    assert _step(spanning, speeds=slow).dp_comm_s > _step(spanning).dp_comm_s
    inside = _plan(dp=8)
    assert _step(inside, speeds=slow).dp_comm_s == _step(inside).dp_comm_s
    # ZeRO-3 moves 1.5x the bytes of ZeRO-0 per step (the ZeRO paper). DeepSpeed's ZeRO-1/2
    # all-reduce the gradients like ZeRO-0 and then all-gather the updated parameters (another
    # half of an all-reduce); ZeRO-2 all-reduces every micro-batch.
    # The gather runs inside the optimizer step, a part of its own.
    def moved(step):
        return step.dp_comm_s + step.dp_gather_s

    z0, z1, z3 = (_step(_plan(zero_stage=z, grad_accum_steps=1), model=_model(param_modules=1)) for z in (0, 1, 3))
    assert z0.dp_gather_s == z3.dp_gather_s == 0 and z1.dp_gather_s == pytest.approx(z0.dp_comm_s / 2)
    assert moved(z3) / moved(z0) == pytest.approx(1.5, rel=0.01)
    assert moved(z1) / moved(z0) == pytest.approx(1.5, rel=0.01)
    z1_m4, z2_m4 = (moved(_step(_plan(zero_stage=z, grad_accum_steps=4))) for z in (1, 2))
    assert z2_m4 / z1_m4 == pytest.approx(4.5 / 1.5, rel=0.01)
    # Offloading the optimizer adds host-link traffic.
    assert _step(_plan(zero_stage=1, offload_optimizer=Offload.cpu)).offload_s > 0
    # More tensor parallelism: less compute per device, more all-reduce.
    tp2, tp8 = _step(_plan(dp=4, tp=2)), _step(_plan(dp=1, tp=8))
    assert tp8.compute_s < tp2.compute_s and tp8.tp_comm_s > tp2.tp_comm_s
    # More devices for the same batch: a shorter step.
    assert _step(_plan(dp=32, grad_accum_steps=2)).total_s < _step(_plan(dp=8, grad_accum_steps=8)).total_s


def test_tflops_and_tokens_follow_from_the_step_time():
    plan = _plan(dp=8, grad_accum_steps=8)
    t = _step(plan)
    assert t.tokens_per_s == pytest.approx(64 * 2048 / t.total_s)
    assert t.tflops_per_device == pytest.approx(10**15 * 64 / t.total_s / 8 / 1e12)
    assert t.tflops_per_device < SPEEDS.tflops_at(2048)  # never above the sustained matmul rate


def test_measured_model_cost_matches_counted_flops_and_the_gpt_shapes():
    from orch.plans.memory.estimate import ModelProbe

    factory = model_factory(SMALL)
    probe = ModelProbe(factory, lm_inputs(128), tp_layer_specs=TP_LAYER_SPECS)
    cost = measure_model_cost(probe, [1, 2, 4])
    assert cost.flops_per_sample == training_flops_per_sample(factory, lm_inputs(128))
    assert cost.flops_per_sample_checkpointed == training_flops_per_sample(factory, lm_inputs(128), checkpointing=True)
    # 2 layers: proj and mlp.proj are row-parallel (output d_model), qkv and fc column (input d_model).
    assert (cost.row_parallel_layers, cost.column_parallel_layers, cost.n_layers) == (4, 4, 2)
    assert cost.row_parallel_out_per_sample == cost.column_parallel_in_per_sample == 4 * 128 * 128
    assert cost.boundary_per_sample == 128 * 128
    assert cost.tp_param_count[1] == probe.stats.param_count > cost.tp_param_count[2] > cost.tp_param_count[4]


def test_batch_scaled_probe_errs_towards_not_fitting():
    """Measured at micro-batches 1 and 2, extrapolated to 8 and 16: never below the measurement, and
    within 25% of it (the proportional bound is loose for checkpointed backward peaks)."""
    factory = model_factory(SMALL)
    probe = BatchScaledProbe(factory, lm_inputs(128), exact_up_to=2)
    for ckpt in (False, True):
        for micro in (8, 16):
            plan = _plan(micro_batch_size=micro, activation_checkpointing=ckpt, precision=Precision.fp32)
            scaled = probe.activations(plan)
            exact = measure_activations(factory, micro_batch_size=micro, inputs=lm_inputs(128), dtype=torch.float32,
                                        checkpointing=ckpt)
            for name in ("saved", "forward_peak", "backward_peak", "backward_peak_with_grads"):
                ratio = getattr(scaled, name) / getattr(exact, name)
                assert 1.0 <= ratio < 1.25, (ckpt, micro, name, ratio)


def test_batch_scaled_probe_counts_a_pipelines_stages_as_the_exact_probe_does():
    """The tuner's probe measures the pipeline layers at micro-batch 1 and scales them; every byte
    of a stage at a larger micro-batch (saved, in flight, DeepSpeed's receive and output buffers)
    is then the exact probe's, and the stages are cut in the same places."""
    from orch.plans.memory.estimate import ModelProbe
    from orch.workload import resolve_workload

    typed, model_cfg, _ = to_typed(compose_config("plan.dp=1", "plan.pp=2", "plan.micro_batch_size=4",
                                                  "plan.grad_accum_steps=8", "model.n_layer=4"))
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    arguments = dict(tp_layer_specs=workload.tp_layer_specs, pipeline_layers=workload.pipeline_layers)
    exact = ModelProbe(workload.model_factory, workload, **arguments)
    scaled = BatchScaledProbe(workload.model_factory, workload, exact_up_to=1, **arguments)
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    fields = ("start", "stop", "saved_bytes", "in_flight", "buffer_bytes", "boundary_buffer_bytes", "in_flight_bytes")
    for micro, accum in ((4, 8), (8, 1)):
        at = dataclasses.replace(plan, micro_batch_size=micro, grad_accum_steps=accum)
        for mine, theirs in zip(scaled.stages(at), exact.stages(at), strict=True):
            assert [getattr(mine, f) for f in fields] == pytest.approx([getattr(theirs, f) for f in fields],
                                                                       rel=0.02), (micro, accum)
        assert scaled.stages(at)[-1].buffer_bytes > 2 * scaled.stages(dataclasses.replace(at, micro_batch_size=1))[
            -1].buffer_bytes


DEEP = {**SMALL, "n_layer": 12, "d_model": 64, "vocab_size": 512}


def test_depth_scaled_counts_match_full_counts_of_a_deep_gpt():
    """Counted at depths 2 and 4 and extrapolated to 12: the same FLOPs, kernel launches and
    all-reduce sizes as counting all 12 layers."""
    from orch.plans.memory.estimate import ModelProbe

    probe = ModelProbe(model_factory(DEEP), lm_inputs(128), tp_layer_specs=TP_LAYER_SPECS)
    assert measure_model_cost(probe, [1, 2], depth_scaled=True) == measure_model_cost(probe, [1, 2])


def assert_depth_scaled_counts_as_full(module: torch.nn.Module, cases: list[dict], monkeypatch) -> None:
    """Each case's activations of ``module`` counted from two shallow copies equal the full depth's,
    without falling back to counting the full depth."""
    from orch.plans.memory import activations

    full = [measure_activations(module, **kwargs) for kwargs in cases]

    def no_full_count(*_args, **_kwargs):
        raise AssertionError("fell back to counting the full depth")

    monkeypatch.setattr(activations, "measure_activations", no_full_count)
    for kwargs, expected in zip(cases, full, strict=True):
        assert activations.measure_activations_depth_scaled(module, **kwargs) == expected, kwargs


@pytest.mark.parametrize("shape", [{}, {"d_model": 256, "seq_len": 16}, {"n_layer": 9, "tie_embeddings": False}],
                         ids=["activations dominate", "gradients dominate", "untied head"])
def test_depth_scaled_activations_match_a_full_measurement(shape, monkeypatch):
    """Peaks included: with gradients larger than a layer's activations the peak with gradients
    held moves from the start of backward to its end as the model deepens, and must still match."""
    cfg = {**DEEP, **shape}
    with torch.device("meta"):
        module = model_factory(cfg)()
    cases = [dict(micro_batch_size=micro, inputs=lm_inputs(cfg["seq_len"]), dtype=dtype, checkpointing=ckpt)
             for ckpt in (False, True) for dtype in (torch.float32, torch.bfloat16) for micro in (1, 2)]
    assert_depth_scaled_counts_as_full(module, cases, monkeypatch)


def test_depth_scaled_activations_of_a_sequence_parallel_shard_match_a_full_measurement(monkeypatch):
    """A tensor-parallel shard with sequence parallelism, checkpointed or not: its first block cuts
    its input (again when recomputed in backward), so it runs more than the others, which the
    extrapolation allows; the counts are still the full depth's, as the tuner takes them."""
    import copy

    from orch.plans.parallel.sequence_parallel import split_sequence_on_meta
    from orch.plans.parallel.tp_plan import shard_module

    with torch.device("meta"):
        module = model_factory(DEEP)()
    shard = split_sequence_on_meta(shard_module(copy.deepcopy(module), TP_LAYER_SPECS, 2), TP_LAYER_SPECS, 2)
    cases = [dict(micro_batch_size=2, inputs=lm_inputs(DEEP["seq_len"]), dtype=torch.float32, checkpointing=ckpt)
             for ckpt in (False, "full", "selective")]
    assert_depth_scaled_counts_as_full(shard, cases, monkeypatch)


def test_depth_scaling_counts_in_full_unless_the_layers_are_identical():
    from orch.plans.model.depth_scaling import repeated_stack, shallow_copy

    with torch.device("meta"):
        deep = model_factory(DEEP)()
        shallow = model_factory(SMALL)()  # 2 layers: nothing to gain
    assert repeated_stack(deep) is deep.blocks and repeated_stack(shallow) is None
    assert len(shallow_copy(deep, deep.blocks, 2).blocks) == 2 and len(deep.blocks) == 12  # the original is untouched
    deep.blocks[5].mlp.fc = torch.nn.Linear(64, 128, device="meta")  # one layer differs
    assert repeated_stack(deep) is None


# --- the 175B search -----------------------------------------------------------------------------

def test_175b_on_1024_devices_picks_model_parallel_plans():
    # How long this takes is measured in bench/tuner_speed.py, not asserted here.
    typed, model_cfg, _ = to_typed(compose_config("model=gpt3_175b", "cluster=a100_8x", "cluster.nodes=128",
                                                  "plan.precision=bf16", "train.global_batch_size=1536"))
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    result = search(space, ctx)
    # Again with the model's measurements cached (as when the cluster or the batch changes).
    again = search(dataclasses.replace(space, global_batch_size=3072), ctx)
    assert result.enumerated > 5000 and len(result.ranked) > 50
    assert again.enumerated > 5000 and again.ranked
    best = result.best.plan
    assert best.tp * best.pp > 1  # 175B does not train on data parallelism alone at this batch
    assert result.rejected["tp does not divide cluster.devices_per_node (a tensor-parallel group stays in one node)"]
    assert ctx.model_cost.n_layers == 96


def test_declared_speeds_from_the_cluster():
    s = Speeds.declared(A100)
    assert s.tflops_at(1) == s.tflops_at(10**6) == pytest.approx(312 * 0.8)
    assert s.source == "declared"


def _declared(cluster: ClusterSpec) -> dict[str, float]:
    s = Speeds.declared(cluster)
    return {"device_tflops": s.tflops_at(1) / 0.8, "intra_node_gbps": s.intra_node_gbps,
            "inter_node_gbps": s.inter_node_gbps, "host_link_gbps": s.host_link_gbps,
            "device_memory_gb_per_s": s.device_memory_gb_per_s, "host_memory_gb_per_s": s.host_memory_gb_per_s}


def test_speeds_a_cluster_leaves_unset_are_its_accelerators_and_those_it_sets_are_kept():
    a100 = {"device_tflops": 312, "intra_node_gbps": 2400, "inter_node_gbps": 200, "host_link_gbps": 256,
            "device_memory_gb_per_s": 2039, "host_memory_gb_per_s": 409}
    cpu = {"device_tflops": 0.1, "intra_node_gbps": 40, "inter_node_gbps": 10, "host_link_gbps": 80,
           "device_memory_gb_per_s": 5, "host_memory_gb_per_s": 10}
    assert _declared(ClusterSpec()) == pytest.approx(cpu)
    assert _declared(ClusterSpec(accelerator=Accelerator.gpu)) == pytest.approx(a100)
    assert _declared(A100) == pytest.approx(a100)
    # What is set stays as set, on either accelerator, even where it looks like the other's.
    h100 = ClusterSpec(accelerator=Accelerator.gpu, device_tflops=989, device_memory_gb_per_s=3350)
    assert _declared(h100) == pytest.approx({**a100, "device_tflops": 989, "device_memory_gb_per_s": 3350})
    slow_gpu = ClusterSpec(accelerator=Accelerator.gpu, device_memory_gb_per_s=5)
    assert _declared(slow_gpu)["device_memory_gb_per_s"] == 5
    assert _declared(dataclasses.replace(A100, accelerator=Accelerator.cpu)) == pytest.approx(a100)


def test_a_gpu_declared_over_the_cpu_preset_gets_gpu_speeds_except_those_given():
    typed, _, _ = to_typed(compose_config("cluster.accelerator=gpu", "cluster.device_tflops=312",
                                          "cluster.host_memory_gb_per_s=800"))
    speeds = _declared(typed.cluster)
    assert speeds["device_memory_gb_per_s"] == 2039 and speeds["intra_node_gbps"] == 2400
    assert speeds["device_tflops"] == pytest.approx(312) and speeds["host_memory_gb_per_s"] == 800
    typed, _, _ = to_typed(compose_config())
    assert _declared(typed.cluster)["device_memory_gb_per_s"] == 5


# --- the command line ----------------------------------------------------------------------------

def test_orch_tune_json_from_the_command_line(tmp_path):
    import json


    def orch(*args):
        return orch_run(["tune", *args], cwd=tmp_path, timeout=300)

    out = tmp_path / "winner.yaml"
    done = orch("--json", f"tune.out={out}", "tune.top_k=3", "train.global_batch_size=16")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # stdout is the JSON document and nothing else
    assert len(doc["candidates"]) == 3 and doc["enumerated"] == doc["feasible"] + sum(doc["rejected"].values())
    for c in doc["candidates"]:
        assert c["feasible"] and set(c["predicted"]) >= {"step_time_s", "tokens_per_s", "tflops_per_device",
                                                         "peak_bytes"}
        assert "measured" not in c  # no trials were run
    steps = [c["predicted"]["step_time_s"] for c in doc["candidates"]]
    assert steps == sorted(steps)
    assert doc["best"]["plan"] == doc["candidates"][0]["plan"] and doc["best"]["plan_file"] == str(out)
    assert doc["speeds"]["source"] == "declared" and not (tmp_path / "mlflow.db").exists()
    assert "Started a local Ray instance" not in done.stderr  # analytic: no Ray without trials or address


def test_orch_tune_prices_a_gpu_declared_over_the_cpu_preset_at_gpu_speeds(tmp_path):
    """`orch tune cluster.accelerator=gpu cluster.device_tflops=312` for GPT-3 175B at tp=8 pp=8 on
    64 GPUs: the optimizer step was priced at the CPU preset's 5 GB/s memory bandwidth (16.8 s)."""
    import json


    done = orch_run(["tune", "--json", "model=gpt3_175b", "cluster.accelerator=gpu", "cluster.device_tflops=312",
                     "cluster.nodes=8", "cluster.devices_per_node=8", "cluster.device_memory_gib=80",
                     "cluster.host_memory_gib=1024", "plan.precision=bf16", "tune.tp=[8]", "tune.pp=[8]",
                     "tune.offload=[none]"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    speeds = doc["speeds"]
    assert speeds["matmul_tflops"] == [[1, pytest.approx(312 * 0.8)]]
    assert speeds["device_memory_gb_per_s"] == 2039 and speeds["intra_node_gbps"] == 2400
    for named in ("cluster.device_memory_gb_per_s=2039", "cluster.intra_node_gbps=2400", "gpu defaults"):
        assert named in speeds["note"] and named in done.stderr
    assert "cluster.device_tflops=" not in speeds["note"]  # given, so not a default
    best = doc["candidates"][0]["predicted"]["parts_s"]
    # 175B / 64 devices of Adam states read and written at 2 TB/s: tens of milliseconds.
    assert best["optimizer"] < 0.5, best


def test_table_names_rejections_and_the_winner(tmp_path):
    from orch.tune.result import render
    from orch.tune.search import tune

    out = tmp_path / "winner.yaml"
    typed, model_cfg, _ = to_typed(compose_config(f"tune.out={out}", "train.global_batch_size=16", "cluster.nodes=2",
                                                  "cluster.devices_per_node=1", "tune.pp=[1]"))
    table = render(tune(typed, model_cfg), top_k=5)
    assert "rejected, by reason:" in table and "tp does not divide cluster.devices_per_node" in table
    assert f"written to {out}" in table and "or: orch train plan.engine=" in table and " plan.dp=" in table
    assert "winner (best predicted)" in table and out.exists()


def _files(root) -> dict:
    return {path: path.stat().st_mtime_ns for path in root.rglob("*")}


def test_tune_writes_the_winner_outside_the_package_and_prints_a_command_that_selects_it(tmp_path, monkeypatch,
                                                                                            capsys):
    """The default plan file goes under the current directory; the printed `orch train` arguments,
    given to `orch config` (same Hydra app, composes without training), select it as plan=<name>."""
    import shlex
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    from orch import cli, conf
    from orch.tune.result import render
    from orch.tune.search import tune

    monkeypatch.chdir(tmp_path)
    package_conf = Path(conf.__file__).resolve().parent
    before = _files(package_conf)
    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=16", "tune.pp=[1]", "tune.name=mine"))
    result = tune(typed, model_cfg)
    assert _files(package_conf) == before
    assert result.plan_file == Path("tuned_plans/plan/mine.yaml") and (tmp_path / result.plan_file).is_file()
    command = [line.split("train it: ", 1)[1] for line in render(result, top_k=3).splitlines() if "train it: " in line]
    assert command == ["orch train --config-dir tuned_plans plan=mine train.global_batch_size=16"]
    assert result.as_json(3)["best"]["train_command"] == command[0]

    # What `orch config ARGS` runs once it has chosen the Hydra app (main() itself must run before
    # Ray is imported, which this test process has done): Hydra parses ARGS from sys.argv.
    monkeypatch.setattr(sys, "argv", ["orch-config", *shlex.split(command[0])[2:]])
    capsys.readouterr()
    cli.config_app()
    composed = OmegaConf.create(capsys.readouterr().out)
    plan = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PlanSpec), composed.plan))
    assert plan == plan_spec(result.winner.plan) and composed.train.global_batch_size == 16


def test_a_tuned_plan_may_not_take_the_name_of_a_shipped_plan(tmp_path, monkeypatch):
    from orch.plans.errors import PlanError
    from orch.tune.search import tune

    monkeypatch.chdir(tmp_path)
    for name in ("ddp", "plan_schema"):
        typed, model_cfg, _ = to_typed(compose_config(f"tune.name={name}"))
        with pytest.raises(PlanError, match=rf"tune.name='{name}': plan={name} names a plan shipped with orch"):
            tune(typed, model_cfg)
    typed, model_cfg, _ = to_typed(compose_config("tune.out=mine/plan/pipeline.yaml"))
    with pytest.raises(PlanError, match=r"tune.out='mine/plan/pipeline.yaml': .* Fix: give the file another name"):
        tune(typed, model_cfg)
    assert not (tmp_path / "tuned_plans").exists() and not (tmp_path / "mine").exists()


def test_bad_search_space_is_refused_naming_the_field():
    from orch.plans.errors import PlanError

    typed, model_cfg, _ = to_typed(compose_config("tune.offload=[gpu]"))
    with pytest.raises(PlanError, match=r"tune.offload=\['gpu'\]: the tuner offloads to none or cpu only"):
        prepare(typed, model_cfg, typed.cluster)


def test_cpu_workers_sharing_cores_get_their_share_of_a_lone_workers_speed():
    from orch.launchers.calibration import cpu_share

    alone = {"tflops": [0.02, 0.04], "device_gb_per_s": 10.0, "op_overhead_s": 1e-5, "cores": 2, "threads": 1}
    # 4 one-thread workers on 2 cores: half a core each.
    shared = cpu_share(alone, workers_on_node=4)
    assert shared["tflops"] == [0.01, 0.02] and shared["device_gb_per_s"] == 5.0
    assert shared["op_overhead_s"] == 2e-5 and shared["share"] == 0.5
    # As many one-thread workers as cores: each has a core of its own, nothing changes.
    assert cpu_share(alone, workers_on_node=2)["tflops"] == alone["tflops"]
    # Two 2-thread workers on 2 cores are oversubscribed too.
    assert cpu_share({**alone, "threads": 2}, workers_on_node=2)["share"] == 0.5


def test_a_calibration_says_when_other_work_shared_the_host_with_its_probes():
    """Rates measured beside other work are the shared host's: the H200 check's host-memory probe
    read 16 GB/s instead of about 195 while compilers ran. The node's busy cores less the probing
    workers' own are the other work; over a quarter of the cores (and over one) is said."""
    from orch.launchers.calibration import disturbance, disturbed_note

    quiet = {"node-a": [{"busy_cores": 14.2, "own_cores": 13.9, "cpus": 16}]}
    assert disturbance(quiet) == ""
    # Two GPU workers of one node probe at once: both their cores are theirs, not other work.
    pair = {"node-a": [{"busy_cores": 28.0, "own_cores": 14.0, "cpus": 32}, {"busy_cores": 27.5, "own_cores": 13.5,
                                                                               "cpus": 32}]}
    assert disturbance(pair) == ""
    busy = {"node-a": [{"busy_cores": 15.8, "own_cores": 2.1, "cpus": 16}],
            "node-b": [{"busy_cores": 3.0, "own_cores": 2.9, "cpus": 16}]}
    said = disturbance(busy)
    assert said == "other processes kept 13.7 of node-a's 16 cores busy"
    assert disturbed_note(said) == ("measured on a busy host (other processes kept 13.7 of node-a's 16 cores busy "
                                    "while the probes ran), so the host-side speeds may be far below the node's: "
                                    "measure again with `orch calibrate` when the node is otherwise idle")
    # One core of other work on a 2-core machine is not over one core.
    assert disturbance({"ci": [{"busy_cores": 1.9, "own_cores": 0.9, "cpus": 2}]}) == ""


def test_the_calibrations_load_sample_sees_processes_that_compete_with_its_probe():
    """A real probe (the host copy) beside busy-looping processes, one more than the cores: the
    sample of /proc/stat and of the probe's own CPU time finds the others' work."""
    import os
    import subprocess
    import sys

    import torch

    from orch.launchers.calibration import _copy_gb_per_s, disturbance, node_cpu_times, probe_load

    cpus = os.cpu_count() or 1
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus + 1)]
    try:
        before = node_cpu_times()
        _copy_gb_per_s(torch.device("cpu"), seconds=0.6)
        after = node_cpu_times()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    load = probe_load(before, after)
    assert load["cpus"] == cpus and 0 < load["own_cores"] < load["busy_cores"] <= cpus + 0.5
    assert "other processes kept" in disturbance({"here": [load]})


def test_trials_try_each_layout_before_another_zero_stage_of_one():
    from orch.plans.search.space import plan_layout, trial_candidates

    typed, model_cfg, _ = to_typed(compose_config("train.global_batch_size=16"))
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    ranked = search(space, ctx).ranked

    def layout(c):
        return plan_layout(c.plan)

    layouts = list(dict.fromkeys(layout(c) for c in ranked))
    picked = trial_candidates(ranked, len(layouts) + 2)
    # One trial per layout, each its best predicted plan, in predicted order...
    assert [layout(c) for c in picked[:len(layouts)]] == layouts
    assert all(c is next(r for r in ranked if layout(r) == layout(c)) for c in picked[:len(layouts)])
    # ...then the next best predicted of the plans left, and never a plan twice.
    left = [c for c in ranked if c not in picked[:len(layouts)]]
    assert picked[len(layouts):] == left[:2]
    assert trial_candidates(ranked, 3) == picked[:3] and trial_candidates(ranked, 0) == []


def test_a_trial_is_bounded_by_the_trial_timeout_in_setup_and_in_training():
    from orch.tune.trials import trial_config

    typed, _, _ = to_typed(compose_config("tune.trial_timeout_s=120"))
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    trial = trial_config(typed, plan, 1, "tune")
    # A trial stuck before its first step (setup) or between steps is stopped, and tuning goes on.
    assert (trial.train.setup_timeout_s, trial.train.hang_timeout_s) == (120, 120)
    unlimited, _, _ = to_typed(compose_config("tune.trial_timeout_s=120", "train.setup_timeout_s=0",
                                              "train.hang_timeout_s=0"))
    trial = trial_config(unlimited, plan, 1, "tune")
    assert (trial.train.setup_timeout_s, trial.train.hang_timeout_s) == (120, 120)


def test_a_calibration_cache_that_cannot_be_read_or_written_is_measured_again_not_fatal(tmp_path):
    from orch.launchers.calibration import _cache_speeds, _cached_speeds
    from orch.plans.spec import ClusterSpec
    from orch.plans.step_time.cost_model import Speeds

    speeds = dataclasses.replace(Speeds.declared(ClusterSpec()), source="measured")
    cache = tmp_path / "calibration-0123.json"
    assert _cache_speeds(cache, speeds) is None and _cached_speeds(cache) == speeds
    assert [p.name for p in tmp_path.iterdir()] == [cache.name]  # no partial file left beside it
    # Read as plain JSON into this version's speeds: anything else means measuring again.
    for text in ('{"matmul_tflops": [[64, 1.0]], "unknown": 1}', '{"intra_node_gbps": 1', "[1, 2]", ""):
        cache.write_text(text)
        assert _cached_speeds(cache) is None, text
    assert _cached_speeds(tmp_path / "none.json") is None
    # Numbers no measurement gives (NaN crashed `orch tune` with a ZeroDivisionError) are measured again.
    import json

    good = json.loads(json.dumps(dataclasses.asdict(speeds)))
    good.pop("source")
    for field, bad in (("intra_node_gbps", float("nan")), ("device_memory_gb_per_s", 0), ("op_overhead_s", -1.0),
                       ("matmul_tflops", [[1, float("inf")]]), ("matmul_tflops", [])):
        cache.write_text(json.dumps({**good, field: bad}))
        assert _cached_speeds(cache) is None, (field, bad)
    cache.write_text(json.dumps(good))
    assert _cached_speeds(cache) == speeds
    # Even root cannot create files under /proc.
    why = _cache_speeds(Path("/proc/orch-cache/calibration-0123.json"), speeds)
    assert why.startswith("/proc/orch-cache/calibration-0123.json could not be written ("), why
