"""FSDP2 plans in the planner: validation, per-part memory with hand-checked arithmetic, the
data-parallel time and the tuner's engine dimension. All pure: no Ray, no torch.distributed."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.config import compose_config, gpu_plan
from orch.config import to_typed
from orch.plans.engine_settings import EngineSettings, ZeroStage, engine_settings
from orch.plans.engines import engine_spec
from orch.plans.engines.fsdp2_memory import FSDPMesh, FSDPUnits, fsdp_memory, fsdp_mesh, fsdp_units
from orch.plans.engines.fsdp2_time import fsdp_dp_comm_s
from orch.plans.errors import PlanError
from orch.plans.memory.activations import ActivationBytes
from orch.plans.memory.states import ModelStats
from orch.plans.resolve import resolve_plan
from orch.plans.search.space import SearchSpace, plan_spec
from orch.plans.spec import (
    Accelerator,
    ClusterSpec,
    FSDPSpec,
    Offload,
    OptimizerName,
    OptimSpec,
    PlanSpec,
    Precision,
    TrainSpec,
)
from orch.plans.step_time.cost_model import ModelCost, Speeds, _half_ring_s, predict_step
from orch.tune.plan_file import plan_overrides, plan_values

FSDP2 = "fsdp2"


def refusal(plan: PlanSpec, cluster: ClusterSpec | None = None) -> PlanError:
    with pytest.raises(PlanError) as info:
        resolve_plan(plan, cluster or ClusterSpec(nodes=2, devices_per_node=4), TrainSpec())
    return info.value


# --- validation ----------------------------------------------------------------------------------

def test_fsdp2_refuses_every_deepspeed_only_setting_at_once_naming_field_and_fix():
    error = refusal(PlanSpec(engine=FSDP2, pp=2, grad_accum_steps=2, zero_stage=3, offload_param=Offload.cpu,
                             pp_partition="bogus"))
    assert [v.field for v in error.violations] == ["plan.pp_partition", "plan.zero_stage", "plan.offload_param"]
    partition, stage, offload = error.violations
    assert partition.fix.startswith("set plan.pp_partition to parameters, uniform or type:REGEX")
    assert "always shards parameters, gradients and optimizer states" in stage.message
    assert "plan.zero_stage at its default (0)" in stage.fix
    assert "(plan.offload_optimizer=none)" in offload.message
    assert offload.fix.startswith("set plan.offload_optimizer=cpu")
    # The DeepSpeed rules these settings would break are not reported beside them.
    assert "DeepSpeed's pipeline engine" not in str(error) and "ZeRO stage 3" not in str(error)


def test_fsdp2_takes_fp16_on_any_accelerator():
    """The engine scales fp16 losses with FSDP2's ``ShardedGradScaler`` (tests/test_fsdp2_engine.py
    trains a ViT in fp16 on CPU); DeepSpeed's fp16 needs a GPU."""
    for accelerator in (Accelerator.cpu, Accelerator.gpu):
        plan = resolve_plan(PlanSpec(engine=FSDP2, precision=Precision.fp16), ClusterSpec(accelerator=accelerator),
                            TrainSpec())
        assert (plan.engine, plan.precision) == (FSDP2, Precision.fp16)


def test_fsdp2_offloads_to_cpu_only():
    error = refusal(PlanSpec(engine=FSDP2, offload_optimizer=Offload.nvme, offload_param=Offload.nvme,
                             nvme_path="/nvme"))
    assert [v.field for v in error.violations] == ["plan.offload_optimizer", "plan.offload_param"]
    assert all("no NVMe offload" in v.message for v in error.violations)
    plan = resolve_plan(PlanSpec(engine=FSDP2, offload_optimizer=Offload.cpu, offload_param=Offload.cpu),
                        ClusterSpec(), TrainSpec())
    assert (plan.engine, plan.zero_stage, plan.offload_param) == (FSDP2, 0, Offload.cpu)


def test_fsdp_settings_under_deepspeed_are_refused_by_name():
    error = refusal(PlanSpec(fsdp=FSDPSpec(reshard_after_forward=False, hybrid=True)))
    assert [v.field for v in error.violations] == ["plan.fsdp.reshard_after_forward", "plan.fsdp.hybrid"]
    assert str(error.violations[1]) == ("plan.fsdp.hybrid=True: is an FSDP2 setting, which plan.engine=deepspeed "
                                        "ignores. Fix: set plan.engine=fsdp2 to use it, or leave plan.fsdp.hybrid "
                                        "at its default (false)")


def test_compile_is_the_fsdp2_engines_and_is_refused_under_deepspeed_with_the_fix():
    error = refusal(PlanSpec(compile=True))
    [violation] = error.violations
    assert (violation.field, violation.value) == ("plan.compile", True)
    assert violation.fix == "set plan.engine=fsdp2 to compile, or plan.compile=false"
    plan = resolve_plan(PlanSpec(engine=FSDP2, compile=True), ClusterSpec(), TrainSpec())
    assert plan.compile and plan.layout_text().endswith(" compile=true") and plan.as_dict()["compile"] is True
    typed, _, _ = to_typed(compose_config())
    assert "plan.compile=true" in plan_overrides(plan, typed)
    assert "compile" not in resolve_plan(PlanSpec(), ClusterSpec(), TrainSpec()).layout_text()
    # The tuner tries compile only with the engine that compiles (tune.compile=[false,true] by default).
    assert typed.tune.compile == [False, True]
    space = SearchSpace(world_size=4, global_batch_size=8, engines=("deepspeed", FSDP2), tp=(1,), pp=(1,),
                        compile=(False, True))
    plans = list(space.plans())
    assert {p.compile for p in plans if p.engine == "deepspeed"} == {False}
    assert {p.compile for p in plans if p.engine == FSDP2} == {False, True}


def test_the_resolved_plan_is_flat_and_round_trips_through_overrides_and_plan_files():
    plan = resolve_plan(PlanSpec(engine=FSDP2, fsdp=FSDPSpec(reshard_after_forward=False), precision=Precision.bf16),
                        ClusterSpec(), TrainSpec())
    flat = plan.as_dict()
    assert flat["engine"] == "fsdp2" and flat["fsdp.reshard_after_forward"] is False and flat["fsdp.hybrid"] is False
    assert "fsdp" not in flat
    assert not any(k.startswith("fsdp") for k in resolve_plan(PlanSpec(), ClusterSpec(), TrainSpec()).as_dict())
    typed, _, _ = to_typed(compose_config())
    overrides = plan_overrides(plan, typed)
    assert "plan.engine=fsdp2" in overrides and "plan.fsdp.reshard_after_forward=false" in overrides
    again, _, _ = to_typed(compose_config(*overrides))
    assert again.plan == plan_spec(plan)
    assert plan_values(plan)["fsdp"] == {"reshard_after_forward": False, "hybrid": False}


# --- memory, by hand -----------------------------------------------------------------------------

# 1000 parameters: a root of 200 (embeddings, head) and 8 blocks of 100; all trainable.
STATS = ModelStats(param_count=1000, trainable_count=1000, largest_layer_params=100, largest_param=100)
UNITS = FSDPUnits(root=200, root_trainable=200, largest_block=100, largest_block_trainable=100, blocks=800)
ACTS = ActivationBytes(saved=0, recompute_peak=0, forward_peak=10_000, backward_peak=12_000,
                       blocks_backward_peak=11_000, later_blocks_backward_peak=9_000, blocks_backward_end=3_000)


def memory(*, shard: int = 4, reshard: bool = True, offload: Offload = Offload.none, accum: int = 1,
           fused: bool = True):
    engine = EngineSettings(zero_stage=ZeroStage.parameters, reshard_after_forward=reshard,
                            offload_optimizer=offload, offload_param=offload, torch_adam=True, fused_adam=fused)
    return fsdp_memory(engine, mesh=FSDPMesh(shard=shard), model=STATS, units=UNITS, activations=ACTS,
                       precision=Precision.bf16, optimizer=OptimizerName.adamw, momentum=0.0,
                       grad_accum_steps=accum)


def parts(phase) -> dict[str, int]:
    return {p.name: p.bytes for p in phase.parts if p.bytes}


def test_fsdp2_rank_part_by_part():
    m = memory()
    # Sharded over 4 ranks: fp32 parameters 4 x 250 (the optimizer's master, no second copy), and
    # Adam's two fp32 moments 8 x 250.
    assert parts(m.held) == {"sharded parameters (fp32)": 1000, "optimizer states (sharded)": 2000}
    forward, head, backward, later, leaving, reduction, step = m.phases
    # Forward: activations, the root gathered in bf16 (2 x 200), the current block (2 x 100) and
    # one more block-sized all-gather buffer.
    assert parts(forward) == {"activations": 10_000, "root parameters, gathered (bf16)": 400,
                              "gathered block (bf16)": 200, "all-gather buffer, one block (bf16)": 200}
    # Backward through the loss and the head: the activations' backward peak, the root and its
    # unsharded bf16 gradients (2 x 200), the last block's all-gather in flight; no block's
    # gradients yet.
    assert parts(head) == {"activations": 12_000, "root parameters, gathered (bf16)": 400,
                           "all-gather buffer, one block (bf16)": 200, "root gradients, unsharded (bf16)": 400}
    # Inside the first block backward reaches: the blocks' activation peak, two blocks gathered,
    # the root's gradients and one block's bf16 gradients (2 x 100).
    assert backward.total == 11_000 + 400 + 200 + 200 + 400 + 200 == 12_400
    # The blocks after it: their activation peak, and the previous block's fp32 reduce-scatter
    # input (4 x 100) and output (4 x 100 / 4) beside the same.
    assert later.total == 9_000 + 400 + 200 + 200 + 400 + 200 + 400 + 100 == 10_900
    # Leaving the blocks: what the embedding's backward holds, the last block's reduce-scatter,
    # and every sharded fp32 gradient (4 x 250).
    assert leaving.total == 3_000 + 400 + 400 + 200 + 400 + 1000
    assert reduction.total == 400 + 400 + 800 + 1000
    # torch's fused Adam steps in place: the sharded fp32 gradients alone.
    assert step.total == 1000
    device = m.device_phases()
    assert device.held.total == 3000 and device.binding.phase == "head backward"
    assert m.binding.phase == "head backward" and sum(p.bytes for p in m.at_peak()) == 3000 + 13_000
    assert (m.states.params, m.states.grads, m.states.optimizer_states) == (1000, 1000, 2000)


def test_a_stage_whose_root_comes_before_its_blocks_makes_the_roots_gradients_after_them():
    """A pipeline stage's root may hold only layers before its blocks (the first stage's
    embedding): the blocks' backward then meets none of the root's gradients, which come after
    it, in the root's own reduction; a root with layers after the blocks (head, final norm) meets
    theirs, as a whole model's does."""
    engine = EngineSettings(zero_stage=ZeroStage.parameters, reshard_after_forward=True, offload_optimizer=Offload.none,
                            offload_param=Offload.none, torch_adam=True, fused_adam=True)

    def stage(before_blocks: int):
        units = dataclasses.replace(UNITS, root_trainable_before_blocks=before_blocks)
        return fsdp_memory(engine, mesh=FSDPMesh(shard=4), model=STATS, units=units, activations=ACTS,
                           precision=Precision.bf16, optimizer=OptimizerName.adamw, momentum=0.0)

    whole, first, last = memory(), stage(0), stage(50)
    for index in (2, 3, 4):  # first block backward, later blocks backward, last block reduce-scatter
        assert "root gradients, unsharded (bf16)" not in parts(first.phases[index])
        assert parts(last.phases[index])["root gradients, unsharded (bf16)"] == 2 * 50
        assert parts(whole.phases[index])["root gradients, unsharded (bf16)"] == 2 * 200
    assert parts(first.phases[5]) == parts(whole.phases[5])  # the root's reduction: all of them


def test_fused_adam_steps_in_place_and_fp16_takes_the_multi_tensor_kernel():
    """The engine builds torch's fused AdamW unless fp16's loss scaler is on
    (orch/launchers/engines/fsdp2/engine.py reads the same ``fused_adam``); only the multi-tensor
    kernel makes a temporary of every moment (4 x 1000 / 4 sharded)."""
    assert engine_settings(gpu_plan(engine=FSDP2, precision=Precision.bf16), OptimSpec()).fused_adam
    assert not engine_settings(gpu_plan(engine=FSDP2, precision=Precision.fp16), OptimSpec()).fused_adam
    assert not engine_settings(gpu_plan(engine=FSDP2), OptimSpec(name=OptimizerName.sgd)).fused_adam
    step = memory(fused=False).phases[-1]
    assert parts(step) == {"sharded gradients (fp32)": 1000, "optimizer step temporaries": 1000}


def test_the_loss_backward_meets_no_root_when_the_root_reshards_after_forward():
    """orch passes ``reshard_after_forward`` to the root too: with ``true`` the root is gathered
    again only in the hook on its output's gradient, after the loss's backward. The activations'
    peak there (the logits' gradients) meets no root parameters or gradients; the head's backward
    meets both, with the activations of its own moment. Without resharding the root stays
    gathered and the head phase is counted as one, at the backward peak."""
    split = dataclasses.replace(ACTS, loss_backward_peak=12_000, head_backward_peak=8_000)
    engine = EngineSettings(zero_stage=ZeroStage.parameters, reshard_after_forward=True, offload_optimizer=Offload.none,
                            offload_param=Offload.none, torch_adam=True, fused_adam=True)
    m = fsdp_memory(engine, mesh=FSDPMesh(shard=4), model=STATS, units=UNITS, activations=split,
                    precision=Precision.bf16, optimizer=OptimizerName.adamw, momentum=0.0)
    loss, head = m.phases[1:3]
    assert (loss.phase, head.phase) == ("loss backward", "head backward")
    assert parts(loss) == {"activations": 12_000}
    assert parts(head) == {"activations": 8_000, "root parameters, gathered (bf16)": 400,
                           "all-gather buffer, one block (bf16)": 200, "root gradients, unsharded (bf16)": 400}
    # The step's peak moves into the blocks (12,400, as counted above), under the one-phase 13,000.
    assert m.binding.phase == "first block backward" and m.binding.total == 12_400 < memory().binding.total == 13_000
    engine = dataclasses.replace(engine, reshard_after_forward=False)
    kept = fsdp_memory(engine, mesh=FSDPMesh(shard=4), model=STATS, units=UNITS, activations=split,
                       precision=Precision.bf16, optimizer=OptimizerName.adamw, momentum=0.0)
    assert kept.phases[1].phase == "head backward" and kept.phases[2].phase == "first block backward"


def test_without_reshard_after_forward_every_block_stays_gathered():
    m = memory(reshard=False)
    forward, head, backward = m.phases[:3]
    assert parts(forward)["gathered blocks kept to backward (bf16)"] == 2 * 800
    assert forward.total == 10_000 + 400 + 1600 + 200
    assert head.total == 12_000 + 400 + 1600 + 400
    assert backward.total == 11_000 + 400 + 1600 + 400 + 200
    assert m.binding.total > memory().binding.total


def test_cpu_offload_moves_the_sharded_states_to_the_host():
    m = memory(offload=Offload.cpu)
    assert m.held.total == 0 and len(m.phases) == 6  # the optimizer steps on the host
    assert {p.name: p.bytes for p in m.host} == {"sharded parameters (fp32), on host": 1000,
                                                 "sharded gradients (fp32), on host": 1000,
                                                 "optimizer states, on host": 2000}
    assert m.states.host_total == 4000 and m.states.device_total == 0
    assert [p.total for p in m.phases[1:5]] == [13_000, 12_400, 10_900, 5_400 - 1000]


def test_one_rank_copies_without_a_flat_buffer_and_accumulation_keeps_gradients():
    single = memory(shard=1)
    assert "all-gather buffer, one block (bf16)" not in parts(single.phases[0])
    assert parts(single.held)["sharded parameters (fp32)"] == 4000
    # Each micro-batch reduce-scatters into the sharded gradients, which the next one meets.
    accumulating = memory(accum=2)
    assert [parts(p)["sharded gradients (fp32)"] for p in accumulating.phases[:5]] == [1000] * 5


def test_hybrid_shards_within_a_node_and_replicates_across():
    cluster = ClusterSpec(nodes=2, devices_per_node=4)
    plan = resolve_plan(PlanSpec(engine=FSDP2, fsdp=FSDPSpec(hybrid=True)), cluster, TrainSpec())
    assert fsdp_mesh(plan, 4) == FSDPMesh(shard=4, replicate=2)
    with_tp = dataclasses.replace(plan, dp=4, tp=2)
    assert fsdp_mesh(with_tp, 4) == FSDPMesh(shard=2, replicate=2)
    assert fsdp_mesh(dataclasses.replace(plan, fsdp=FSDPSpec()), 4) == FSDPMesh(shard=8)


def test_units_are_the_blocks_and_the_root_of_the_model():
    from orch.plans.model.meta import meta_device
    from orch.workloads.gpt import GPT

    with meta_device():
        model = GPT(d_model=64, n_head=4, n_layer=3, seq_len=32)
    units = fsdp_units(model)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert units.largest_block == block and units.blocks == 3 * block
    assert units.root == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) - 3 * block


def test_fsdp2_plans_map_onto_zero3_for_the_cost_model():
    plan = gpu_plan(engine=FSDP2, fsdp=FSDPSpec(reshard_after_forward=False))
    settings = engine_settings(plan, OptimSpec())
    assert settings.zero_stage == ZeroStage.parameters and not settings.module_hooks
    assert settings.reshard_after_forward is False and settings.torch_adam


# --- time ----------------------------------------------------------------------------------------

COST = ModelCost(seq_len=128, flops_per_sample=10**12, flops_per_sample_checkpointed=13 * 10**11, param_count=10**9,
                 tp_param_count={1: 10**9}, row_parallel_out_per_sample=0, row_parallel_layers=0,
                 column_parallel_in_per_sample=0, column_parallel_layers=0, boundary_per_sample=0, n_layers=10,
                 param_modules=60)


def test_fsdp2_gathers_and_reduce_scatters_by_hand():
    speeds = Speeds.declared(ClusterSpec(accelerator=Accelerator.gpu, devices_per_node=2))
    speeds = dataclasses.replace(speeds, intra_latency_s=0.0)
    bw = speeds.bus_gbps("intra")
    root = 10**8
    for reshard, gathers in ((True, 2), (False, 1)):
        plan = gpu_plan(dp=2, engine=FSDP2, fsdp=FSDPSpec(reshard_after_forward=reshard))
        got = fsdp_dp_comm_s(plan, COST, speeds, devices_per_node=2, root_params=root)
        # bf16 blocks gathered once or twice and the root once; gradients reduce-scattered in fp32.
        gathered = 2 * ((10**9 - root) * gathers + root)
        assert got == pytest.approx(_half_ring_s(gathered, 2, bw, 0.0) + _half_ring_s(4 * 10**9, 2, bw, 0.0))
    one_rank = gpu_plan(dp=1, engine=FSDP2)
    assert fsdp_dp_comm_s(one_rank, COST, speeds, devices_per_node=2) == 0.0


def test_fsdp2_gathers_and_reduce_scatters_at_their_own_measured_rates():
    """gloo's all_gather_into_tensor and reduce_scatter_tensor run at a third and a quarter of its
    all-reduce's bus rate (what calibration measures): FSDP2's collectives are priced at those."""
    declared = dataclasses.replace(Speeds.declared(ClusterSpec(accelerator=Accelerator.gpu, devices_per_node=2)),
                                   intra_latency_s=0.0)
    speeds = dataclasses.replace(declared, intra_all_gather_share=0.4, intra_reduce_scatter_share=0.25)
    bw = declared.bus_gbps("intra")
    assert speeds.bus_gbps("intra") == bw
    assert speeds.bus_gbps("intra", collective="all_gather") == pytest.approx(0.4 * bw)
    assert speeds.bus_gbps("intra", collective="reduce_scatter") == pytest.approx(0.25 * bw)
    plan = gpu_plan(dp=2, engine=FSDP2, fsdp=FSDPSpec(reshard_after_forward=True))
    got = fsdp_dp_comm_s(plan, COST, speeds, devices_per_node=2)
    assert got == pytest.approx(_half_ring_s(2 * 2 * 10**9, 2, 0.4 * bw, 0.0)
                                + _half_ring_s(4 * 10**9, 2, 0.25 * bw, 0.0))
    assert got == pytest.approx(fsdp_dp_comm_s(plan, COST, declared, devices_per_node=2) * (
        (4 / 0.4 + 4 / 0.25) / (4 + 4)))
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        speeds.bus_gbps("intra", collective="broadcast")


def test_pipeline_stages_reduce_once_per_step_and_gather_once_without_resharding():
    """torch's schedules hold a stage's gradients unreduced and its parameters gathered over the
    step's micro-batches: one reduce-scatter per step, and one gather without reshard_after_forward
    (with it, each micro-batch's backward gathers the blocks its forward resharded)."""
    speeds = dataclasses.replace(Speeds.declared(ClusterSpec(accelerator=Accelerator.gpu, devices_per_node=4)),
                                 intra_latency_s=0.0)
    bw = speeds.bus_gbps("intra")
    m = 8
    for reshard, gathers in ((False, 1), (True, m + 1)):
        plan = gpu_plan(dp=2, pp=2, grad_accum_steps=m, engine=FSDP2, fsdp=FSDPSpec(reshard_after_forward=reshard))
        got = fsdp_dp_comm_s(plan, COST, speeds, devices_per_node=4)
        stage = 10**9 / 2  # the busiest stage's half of the blocks (no root here)
        assert got == pytest.approx(_half_ring_s(2 * stage * gathers, 2, bw, 0.0) + _half_ring_s(4 * stage, 2, bw, 0.0))
        whole = fsdp_dp_comm_s(dataclasses.replace(plan, pp=1), COST, speeds, devices_per_node=4)
        assert got < whole / 2


def test_pipeline_ranks_that_memory_cannot_tell_apart_are_counted_once():
    """A pipelined plan's ranks, and those of a plan that differs only where memory does not look
    (compiled here), are counted once each (the tuner counts hundreds of thousands of ranks for a
    405B model): the twin's estimate is the same and counts no rank again, while a plan whose
    memory differs (no resharding) counts its own."""
    from orch.plans.engines.fsdp2 import _rank_memory
    from orch.plans.memory.estimate import ModelProbe, estimate_plan
    from orch.workload import resolve_workload

    typed, model_cfg, _ = to_typed(compose_config(
        "model.n_layer=4", "plan.engine=fsdp2", "plan.pp=2", "plan.pp_schedule=interleaved_1f1b",
        "plan.pp_virtual_stages=2", "plan.grad_accum_steps=4", "plan.dp=2", "cluster.devices_per_node=4"))
    workload = resolve_workload(model_cfg, typed.objective, typed.data)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs,
                       pipeline_layers=workload.pipeline_layers)
    plan = resolve_plan(typed.plan, typed.cluster, typed.train)
    _rank_memory.cache_clear()
    first = estimate_plan(plan, typed.cluster, typed.optim, probe)
    counted = _rank_memory.cache_info().misses
    assert 0 < counted <= plan.pp
    twin = estimate_plan(dataclasses.replace(plan, compile=True), typed.cluster, typed.optim, probe)
    assert _rank_memory.cache_info().misses == counted
    assert twin.per_device == first.per_device and twin.stages == first.stages
    kept = estimate_plan(dataclasses.replace(plan, fsdp=FSDPSpec(reshard_after_forward=False)), typed.cluster,
                         typed.optim, probe)
    assert _rank_memory.cache_info().misses > counted
    assert kept.per_device.total > first.per_device.total


def predict(plan, *args, **kw):
    return engine_spec(plan.engine).step_time(plan, *args, **kw)


def test_prediction_picks_the_engine_and_credits_prefetch_on_gpus():
    speeds = Speeds.declared(ClusterSpec(accelerator=Accelerator.gpu, devices_per_node=8))
    ds = gpu_plan(zero_stage=3)
    assert predict(ds, COST, speeds, devices_per_node=8, optim=OptimSpec()) == predict_step(
        ds, COST, speeds, devices_per_node=8, optim=OptimSpec())
    fsdp = gpu_plan(engine=FSDP2)
    step = predict(fsdp, COST, speeds, devices_per_node=8, optim=OptimSpec())
    unhidden = fsdp_dp_comm_s(fsdp, COST, speeds, devices_per_node=8)
    assert step.dp_comm_s < unhidden
    assert step.tokens_per_s == pytest.approx(fsdp.global_batch_size * COST.seq_len / step.total_s)


# --- the tuner's search space --------------------------------------------------------------------

def test_the_search_space_adds_fsdp2_with_its_schedules_and_without_zero_stages():
    from orch.plans.spec import PipelineSchedule

    schedules = ((PipelineSchedule.one_f_one_b, 1), (PipelineSchedule.zbv, 2))
    space = SearchSpace(world_size=4, global_batch_size=8, tp=(1,), pp=(1, 2), zero_stages=(0, 1, 2, 3),
                        engines=("deepspeed", FSDP2), micro_batch_sizes=(2,), pp_schedules=schedules)
    plans = list(space.plans())
    fsdp = [p for p in plans if p.engine == FSDP2]
    deepspeed = [p for p in plans if p.engine == "deepspeed"]
    # DeepSpeed runs 1f1b only: its plans are those of a space without other schedules.
    assert deepspeed == list(dataclasses.replace(space, engines=("deepspeed",), pp_schedules=schedules[:1]).plans())
    assert {p.pp for p in fsdp} == {1, 2} and {p.zero_stage for p in fsdp} == {0}
    assert {(p.offload_optimizer, p.offload_param) for p in fsdp} == {(Offload.none, Offload.none),
                                                                      (Offload.cpu, Offload.cpu)}
    assert {p.fsdp.reshard_after_forward for p in fsdp} == {True, False}
    # reshard x offload x recomputation (none, selective, full), at pp=1 and, with both schedules, at pp=2.
    assert len([p for p in fsdp if p.pp == 1]) == 2 * 2 * 3
    assert {(p.pp_schedule, p.pp_virtual_stages) for p in fsdp if p.pp == 2} == {("1f1b", 1), ("zbv", 2)}
    assert len([p for p in fsdp if p.pp == 2]) == 2 * 2 * 3 * 2
    for spec in fsdp:
        if spec.pp == 1 or spec.pp_schedule == "1f1b" or not spec.fsdp.reshard_after_forward:
            resolve_plan(spec, ClusterSpec(devices_per_node=4), TrainSpec(global_batch_size=8))
        else:  # the zero-bubble schedules keep the gathered parameters: the tuner counts why not
            assert engine_spec(FSDP2).rejection(spec) == "a zero-bubble schedule with resharding after forward"


def test_an_unknown_engine_in_the_search_space_is_refused_before_anything_runs():
    from orch.declared import declared_violations

    typed, _, _ = to_typed(compose_config("tune.engines=[deepspeed,fsdp]"))
    (violation,) = [v for v in declared_violations(typed) if v.field == "tune.engines"]
    assert str(violation) == ("tune.engines=['deepspeed', 'fsdp']: the tuner searches the engines deepspeed, fsdp2. "
                              "Fix: set tune.engines=[deepspeed,fsdp2] or a subset of it")


def test_fsdp2_builds_the_model_whole_on_one_worker_of_a_node():
    """The FSDP2 engine builds on meta and fills the shards from rank 0's whole build: a node holds
    the model once (plus the weight files every worker reads), where DeepSpeed's tp plans hold it
    once per worker."""
    from orch.plans.memory.build import build_memory, build_violation
    cluster = ClusterSpec(nodes=1, devices_per_node=4, host_memory_gib=1)
    stages = []  # no pipeline: not read
    fsdp = resolve_plan(PlanSpec(engine=FSDP2), cluster, TrainSpec())
    build = build_memory(fsdp, cluster, built_bytes=600 * 2**20, param_count=1000, stages=stages,
                         weight_file_bytes=2**20)
    assert (build.builders, build.total) == (1, 600 * 2**20 + 4 * 2**20) and build.fits
    deepspeed = resolve_plan(PlanSpec(tp=2), cluster, TrainSpec())
    whole = build_memory(deepspeed, cluster, built_bytes=600 * 2**20, param_count=1000, stages=stages)
    assert whole.total == 4 * 600 * 2**20
    refused = build_violation(whole)
    assert "plan.engine=fsdp2 (one worker builds it whole, the others on meta)" in refused.fix
    too_big = build_memory(fsdp, cluster, built_bytes=3 * 2**29, param_count=1000, stages=stages)
    assert "1 of 4 worker(s) holds (the others build on meta)" in build_violation(too_big).message
