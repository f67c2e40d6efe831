"""`orch check`: the planner's verdict, in process and through the real command line."""

from __future__ import annotations

import json
import subprocess

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers.config import compose_config
from helpers.orch_command import orch_run
from orch.checking import CHECK_JSON_KEYS, CLUSTER_JSON_KEYS, check_document, check_run, checked_run
from orch.config import to_typed
from orch.plans.errors import OrchError, PlanError
from orch.plans.memory.estimate import DEVICE_JSON_KEYS, GIB
from orch.plans.step_time.prediction import declared_plan_step, declared_step_range
from orch.plans.step_time.ranges import ratio_range

BIG = ["model=gpt3_175b", "cluster=a100_8x", "cluster.nodes=128", "plan.precision=bf16", "plan.micro_batch_size=1"]


def check(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return check_run(typed, model_cfg)[0]


def orch(*args: str, cwd) -> subprocess.CompletedProcess:
    return orch_run(args, cwd=cwd, timeout=300)


def test_zero_stages_shrink_the_model_states_per_device():
    # The ZeRO paper's model states (gradients included). What a rank holds between steps does not
    # shrink the same way: DeepSpeed rebuilds stage 1-2 gradients every backward, and stage 3
    # keeps a reduction bucket allocated (test_memory_estimate.py checks those phases).
    estimates = [check(f"plan.zero_stage={s}", "model.d_model=256") for s in range(4)]
    states = [e.states.device_total for e in estimates]
    assert states[0] > states[1] > states[2] > states[3]


def test_the_breakdown_is_the_peak_phase_and_adds_up():
    d = check("plan.zero_stage=2", "model.d_model=256").per_device
    assert d.phase == "backward" and 0 < d.held < d.total
    assert d.params + d.grads + d.optimizer_states + d.activations + d.buffers + d.reserve == d.total


def test_checkpointing_and_smaller_micro_batches_shrink_activations():
    base = check("plan.micro_batch_size=8").per_device.activations
    assert check("plan.micro_batch_size=8", "plan.activation_checkpointing=true").per_device.activations < base
    half = check("plan.micro_batch_size=4").per_device.activations
    assert abs(2 * half - base) / base < 0.01  # linear in the batch, up to per-step constants


def test_a_plan_that_does_not_fit_names_the_binding_constraint_and_fixes():
    estimate = check(*BIG, "plan.zero_stage=1")
    assert not estimate.feasible
    # 175B parameters in fp32 are 652 GiB: 8 workers building them whole do not fit a 1 TiB host either.
    assert [v.field for v in estimate.violations] == ["cluster.device_memory_gib", "cluster.host_memory_gib"]
    assert "per device but a device has 80.00 GiB" in estimate.violations[0].message
    assert "building the model needs" in estimate.violations[1].message
    assert any("plan.zero_stage to 3" in s for s in estimate.suggestions)
    assert check(*BIG, "plan.zero_stage=3", "plan.activation_checkpointing=true").feasible


def test_offload_moves_states_to_host_memory():
    on_device = check("plan.zero_stage=2", "model.d_model=256")
    offloaded = check("plan.zero_stage=2", "model.d_model=256", "plan.offload_optimizer=cpu")
    assert offloaded.per_device.optimizer_states == 0 < on_device.per_device.optimizer_states
    assert offloaded.per_node_host.offloaded > 0 == on_device.per_node_host.offloaded


def test_host_memory_is_checked_per_node():
    estimate = check("plan.zero_stage=3", "plan.offload_optimizer=cpu", "plan.offload_param=cpu",
                     "cluster.host_memory_gib=0.001")
    training, building = estimate.violations
    assert training.field == building.field == "cluster.host_memory_gib"
    assert "offloaded states of 2 workers" in training.message
    assert "2 worker(s) each hold the model as built (zero.Init share" in building.message


def test_check_json_is_one_document_with_the_stable_names(tmp_path):
    done = orch("check", "--json", "plan.zero_stage=3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # nothing but JSON on stdout
    assert doc["feasible"] is True and doc["world_size"] == 2 and doc["plan"]["zero_stage"] == 3
    assert doc["model"]["param_count"] > 0
    assert set(doc["per_device"]) >= {"params", "grads", "optimizer_states", "activations", "buffers", "total",
                                      "capacity", "held", "phase"}
    assert set(doc["phases"]) >= {"held", "forward", "backward"}
    assert doc["per_device"]["capacity"] == 8 * GIB
    assert set(doc["per_node_host"]) >= {"total", "capacity"}
    assert len(doc["stages"]) == 1 and doc["violations"] == []


def test_check_a_175b_model_on_1024_devices_without_allocating_it(tmp_path):
    done = orch("check", "--json", *BIG, "plan.zero_stage=3", "plan.activation_checkpointing=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["world_size"] == 1024 and 174e9 < doc["model"]["param_count"] < 176e9
    # ZeRO-3 mixed-precision Adam: 16 bytes per parameter spread over 1024 devices, plus the
    # parameters under stage3_param_persistence_threshold (biases, LayerNorms) that every rank
    # keeps whole, about 1% here.
    states = doc["per_device"]["params"] + doc["per_device"]["grads"] + doc["per_device"]["optimizer_states"]
    assert 0 <= (states - 16 * doc["model"]["param_count"] / 1024) / states < 0.02


def test_check_table_and_exit_code_for_a_plan_that_does_not_fit(tmp_path):
    done = orch("check", *BIG, "plan.zero_stage=0", cwd=tmp_path)
    assert done.returncode == 1
    assert "verdict  DOES NOT FIT" in done.stdout and "smallest changes that fit:" in done.stdout


def test_train_refuses_a_plan_that_does_not_fit_before_starting_ray(tmp_path):
    done = orch("train", "cluster.device_memory_gib=0.01", cwd=tmp_path)
    assert done.returncode == 2
    assert "cluster.device_memory_gib=0.01: the plan needs" in done.stderr
    assert "train.force=true" in done.stderr
    assert "Started a local Ray instance" not in done.stderr


def test_tensor_parallel_plans_divide_the_sharded_layers_by_tp():
    d, layers = 256, 2
    whole = check("plan.tp=1", "plan.dp=2", f"model.d_model={d}", f"model.n_layer={layers}")
    split = check("plan.tp=2", "plan.dp=1", f"model.d_model={d}", f"model.n_layer={layers}")
    # Per block AutoTP shards qkv and fc (weights and biases) and the two projections' weights.
    sharded = layers * (12 * d * d + 7 * d)
    assert whole.per_device.params - split.per_device.params == 4 * (sharded - sharded // 2)  # fp32
    assert split.model.param_count == whole.model.param_count  # the model itself is unchanged


def test_nvme_offload_counts_against_the_disk_not_host_memory():
    common = ["plan.zero_stage=3", "model.d_model=256", "plan.nvme_path=/nvme"]
    cpu = check(*common, "plan.offload_optimizer=cpu", "plan.offload_param=cpu").per_node_host
    nvme = check(*common, "plan.offload_optimizer=nvme", "plan.offload_param=nvme").per_node_host
    assert cpu.nvme == 0 < nvme.nvme
    assert nvme.offloaded + nvme.nvme == cpu.offloaded


def test_check_says_how_many_threads_an_offloaded_optimizer_steps_on():
    from orch.checking import render

    def report(*overrides: str) -> str:
        return render(check(*overrides), to_typed(compose_config(*overrides))[0].cluster)

    offload = ("plan.zero_stage=2", "plan.offload_optimizer=cpu")
    one = report(*offload, "cluster.accelerator=gpu")
    assert "1 thread per worker (cluster.cpus_per_worker=1" in one and "cluster.cpus_per_worker=8" in one
    eight = report(*offload, "cluster.accelerator=gpu", "cluster.cpus_per_worker=8")
    assert "8 threads per worker" in eight and "spare cores" not in eight
    assert "spare cores" not in report(*offload)  # CPU workers: their cores are the devices
    assert "CPU optimizer" not in report("cluster.accelerator=gpu")


def test_check_predicts_the_declared_plans_step_time_as_tune_prices_it():
    """`orch check` printed memory only; its step time is the tuner's for the same plan."""
    from orch.checking import render
    from orch.plans.search.space import search
    from orch.tune.search import prepare

    overrides = ("plan.zero_stage=2", "cluster.devices_per_node=4", "plan.micro_batch_size=4")
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    step = declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    def layout(plan) -> tuple:
        return (plan.engine, plan.dp, plan.tp, plan.pp, plan.zero_stage, plan.offload_optimizer, plan.offload_param,
                plan.activation_checkpointing, plan.micro_batch_size, plan.grad_accum_steps, plan.precision)

    [tuned] = [c for c in search(space, ctx).ranked if layout(c.plan) == layout(estimate.plan)]
    assert step.total_s == pytest.approx(tuned.predicted.total_s, rel=1e-6)
    text = render(estimate, typed.cluster, [], step)
    assert f"step time  {step.total_s:.3g} s predicted (compute" in text
    assert f"{estimate.plan.global_batch_size / step.total_s:,.1f} samples/s" in text and "orch calibrate" in text
    # No published or measured case checks the declared CPU speeds (an order of magnitude): no range, and why.
    assert "  no range: the cost model's error at declared speeds is known for" in text
    # On declared GPU speeds the published runs' error gives one, on the same line, with where it comes from.
    gpu, gpu_cfg, _ = to_typed(compose_config(*overrides, "cluster=a100_8x"))
    estimate, facts, probe, _ = checked_run(gpu, gpu_cfg)
    step = declared_plan_step(estimate.plan, gpu.cluster, gpu.optim, probe, facts.param_count)
    spread = declared_step_range(step, estimate.plan, gpu.cluster)
    text = render(estimate, gpu.cluster, [], step)
    assert spread.p10 < spread.p90
    assert f"step time  {step.total_s:.3g} s predicted, P10-P90 {spread.p10:.3g}-{spread.p90:.3g} s (compute" in text
    assert "  range: P10-P90 of 11 published runs' measured/predicted step time, bench/megatron_sanity.py" in text


def test_a_micro_batch_the_model_refuses_in_training_is_a_plan_error_and_the_tuner_skips_it():
    """ResNet-50 on 32x32 images ends in a 1x1 feature map whose BatchNorm refuses one sample in
    training: `orch check` crashed with the raw ValueError and `orch tune` stopped at it."""
    from orch.plans.search.space import search
    from orch.tune.search import prepare

    typed, model_cfg, _ = to_typed(compose_config("experiment=resnet50_bf16", "plan.micro_batch_size=1"))
    with pytest.raises(PlanError) as refused:
        check_run(typed, model_cfg)
    [violation] = refused.value.violations
    assert violation.field == "plan.micro_batch_size" and "more than 1 value per channel" in violation.message
    typed, model_cfg, _ = to_typed(compose_config("experiment=resnet50_bf16"))  # a global batch of 16
    space, ctx = prepare(typed, model_cfg, typed.cluster)
    tried = []
    measure = ctx.probe._measure
    ctx.probe._measure = lambda *args: tried.append(args) or measure(*args)
    result = search(space, ctx)
    refused = result.rejected["plan.micro_batch_size: the model refuses a training micro-batch of 1"]
    assert refused > 1
    assert result.ranked and all(c.plan.micro_batch_size > 1 for c in result.ranked)
    # The refusal is kept as a measurement is: each set of measured settings is tried once, not
    # once per plan that asks (a forward and backward pass each).
    assert len(tried) == len(set(tried)) and sum(1 for args in tried if args[0] == 1) < refused


def test_rank_layout_keeps_tensor_parallel_groups_inside_a_node():
    from orch.launchers.placement import rank_layout

    layout = rank_layout(world_size=16, devices_per_node=8, tp=4)
    assert [(s["node"], s["dp_rank"], s["tp_rank"]) for s in layout[:9]] == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3), (1, 2, 0)]
    groups: dict[int, set[int]] = {}
    for slot in layout:
        groups.setdefault(slot["dp_rank"], set()).add(slot["node"])
    assert all(len(nodes) == 1 for nodes in groups.values())


def test_rank_layout_puts_tp_inside_nodes_then_stages_then_replicas_across_nodes():
    from orch.launchers.placement import rank_layout

    # 2 nodes of 4: tp=2 x pp=2 fills a node; the two replicas are the two nodes.
    layout = rank_layout(world_size=8, devices_per_node=4, tp=2, pp=2)
    assert [(s["node"], s["dp_rank"], s["pp_rank"], s["tp_rank"]) for s in layout] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
        (1, 1, 0, 0), (1, 1, 0, 1), (1, 1, 1, 0), (1, 1, 1, 1)]
    # The same grid as DeepSpeed's topology with our axis order.
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from orch.plans.parallel.rank_layout import GRID_AXES

    topo = ProcessTopology(axes=list(GRID_AXES), dims=[2, 2, 2])
    for slot in layout:
        coord = topo.get_coord(slot["rank"])
        assert (coord.data, coord.pipe, coord.model) == (slot["dp_rank"], slot["pp_rank"], slot["tp_rank"])


def test_check_json_shows_the_placement(tmp_path):
    done = orch("check", "--json", "plan.tp=2", "plan.dp=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["placement"] == [
        {"rank": 0, "node": 0, "local_rank": 0, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0},
        {"rank": 1, "node": 0, "local_rank": 1, "dp_rank": 0, "tp_rank": 1, "pp_rank": 0}]


def test_placement_strategy_and_straddling_tensor_parallel_groups():
    from orch.launchers.placement import RankSlot, assign_ranks, placement_strategy, straddling_groups

    assert placement_strategy(1) == "STRICT_PACK" and placement_strategy(4) == "PACK"
    even = assign_ranks(["a", "a", "b", "b"])
    assert straddling_groups(even, tp=2) == []
    # Ray granted 3 devices on one node and 1 on the other: ranks 2 and 3 would all-reduce across nodes.
    uneven = assign_ranks(["a", "a", "a", "b"])
    assert straddling_groups(uneven, tp=2) == [[2, 3]]
    assert straddling_groups(uneven, tp=1) == []
    assert straddling_groups([RankSlot(0, "a", 0, 1)], tp=1) == []


_DEGREES = st.sampled_from([1, 2, 4])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(devices=_DEGREES, dp=st.none() | _DEGREES, tp=_DEGREES, pp=_DEGREES, zero=st.integers(0, 3),
       offload=st.sampled_from(["none", "cpu"]), micro=st.sampled_from([1, 2, 8]), accum=st.sampled_from([1, 4]),
       precision=st.sampled_from(["fp32", "bf16"]), checkpointing=st.booleans(),
       memory=st.sampled_from([0.01, 8.0]))
# The README's pipeline plan, fitting and not: the examples run first, whatever hypothesis draws.
@example(devices=2, dp=None, tp=1, pp=2, zero=1, offload="none", micro=2, accum=4, precision="fp32",
         checkpointing=False, memory=8.0)
@example(devices=4, dp=None, tp=2, pp=2, zero=0, offload="none", micro=1, accum=1, precision="bf16",
         checkpointing=True, memory=0.01)
def test_check_json_document_serializes_with_the_documented_keys(devices, dp, tp, pp, zero, offload, micro, accum,
                                                                   precision, checkpointing, memory):
    overrides = [f"cluster.devices_per_node={devices}", f"plan.dp={'null' if dp is None else dp}", f"plan.tp={tp}",
                 f"plan.pp={pp}", f"plan.zero_stage={zero}", f"plan.offload_optimizer={offload}",
                 f"plan.micro_batch_size={micro}", f"plan.grad_accum_steps={accum}", f"plan.precision={precision}",
                 f"plan.activation_checkpointing={str(checkpointing).lower()}", f"cluster.device_memory_gib={memory}"]
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    try:
        estimate, facts, probe, _ = checked_run(typed, model_cfg)
    except OrchError:
        return  # refused as invalid input: `orch check` prints the problems and exits 2, no document
    step = declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)
    doc = json.loads(json.dumps(check_document(estimate, typed.cluster, [], step)))  # strict: no default=
    assert tuple(doc) == CHECK_JSON_KEYS
    assert tuple(doc["cluster"]) == CLUSTER_JSON_KEYS
    assert doc["feasible"] is estimate.feasible and doc["feasible"] == (doc["violations"] == [])
    for device in [doc["per_device"], *doc["stages"]]:
        assert tuple(device) == DEVICE_JSON_KEYS
    assert len(doc["stages"]) == pp and len(doc["placement"]) == doc["world_size"]
    assert len(doc["pipeline"]["stages"]) == (pp if pp > 1 else 0)
    predicted = doc["predicted_step"]
    assert predicted["step_time_s"] == pytest.approx(sum(predicted["parts_s"].values())) and predicted["speeds"]
    assert tuple(predicted["range_s"]) == ("p10", "p90", "cases", "source")


def test_with_json_the_log_lines_go_to_stderr_and_stdout_holds_the_document_only(tmp_path):
    """A library's warning that reaches the root logger (transformers' note on gradient
    checkpointing, in CI) came before the document on stdout through Hydra's console handler;
    ``hydra.verbose`` makes Hydra itself log there, which makes the case certain."""
    done = orch("check", "--json", "hydra.verbose=true", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    assert tuple(json.loads(done.stdout)) == CHECK_JSON_KEYS
    assert "[HYDRA]" in done.stderr


def test_check_json_of_the_pipeline_plan_through_the_command_line(tmp_path):
    done = orch("check", "--json", "plan=pipeline", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads(done.stdout)
    assert doc["plan"]["pp"] > 1 and [type(s["start"]) for s in doc["pipeline"]["stages"]] == [int] * doc["plan"]["pp"]
    # The declared plan's step time, as `orch tune` prices it: a pipeline's idle bubble among its parts.
    assert doc["predicted_step"]["parts_s"]["bubble"] > 0 and doc["predicted_step"]["step_time_s"] > 0
    # Declared CPU speeds: no measured error, so no range, and the reason instead of its source.
    assert doc["predicted_step"]["range_s"]["p10"] is None
    assert doc["predicted_step"]["range_s"]["source"].startswith("no range: ")


def test_check_json_gives_the_predicted_step_the_range_of_the_cost_models_error(tmp_path):
    """Declared GPU speeds: P10-P90 of the published runs' measured / predicted step time, times the prediction."""
    done = orch("check", "--json", "cluster=a100_8x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    predicted = json.loads(done.stdout)["predicted_step"]
    spread = predicted["range_s"]
    assert set(spread) == {"p10", "p90", "cases", "source"}
    assert 0 < spread["p10"] <= spread["p90"] and spread["cases"] == 11
    ratios = ratio_range("declared", "gpu")
    assert (spread["p10"], spread["p90"]) == (pytest.approx(ratios.p10 * predicted["step_time_s"]),
                                              pytest.approx(ratios.p90 * predicted["step_time_s"]))
    assert spread["source"] == ratios.source and "bench/megatron_sanity.py" in spread["source"]


def test_check_an_fsdp2_plan_names_its_parts_and_engine(tmp_path):
    # With checkpointing the blocks' backward is the binding phase, where every kind of part is alive.
    done = orch("check", "plan.engine=fsdp2", "plan.precision=bf16", "plan.fsdp.reshard_after_forward=false",
                "plan.activation_checkpointing=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "plan     engine=fsdp2 fsdp.reshard_after_forward=false fsdp.hybrid=false dp=2" in out
    assert "FSDP2 per device at the peak (later blocks backward phase), by part; shards over 2 rank(s)" in out
    for part in ("sharded parameters (fp32)", "optimizer states (sharded)", "root parameters, gathered (bf16)",
                 "gathered blocks kept to backward (bf16)", "one block's gradients, unsharded (bf16)",
                 "reduce-scatter input, one block (fp32)", "sharded gradients (fp32)", "FSDP2 buffers"):
        assert part in out, part
    assert "verdict  FITS with fsdp2:" in out
    # Pipeline stages under torch's schedules: the zero-bubble ones keep the gathered parameters.
    zbv = ("plan.engine=fsdp2", "plan.pp=2", "plan.pp_schedule=zbv", "plan.pp_virtual_stages=2",
           "plan.grad_accum_steps=4", "model.n_layer=4")
    refused = orch("check", *zbv, cwd=tmp_path)
    assert refused.returncode == 2
    assert "plan.fsdp.reshard_after_forward=True: the zbv schedule" in refused.stderr
    assert "Fix: set plan.fsdp.reshard_after_forward=false" in refused.stderr
    piped = orch("check", *zbv, "plan.fsdp.reshard_after_forward=false", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "pp=2 pp_schedule=zbv pp_virtual_stages=2" in piped.stdout
    # Rank 0 runs the first and the last stage (the V): the embedding, its tied copy in the head.
    assert "pipeline ranks (parameters partition; zbv, 2 stages per rank schedule;" in piped.stdout
    assert "rank 0: layers 0-6 (Embedding, Block x 2, LayerNorm, Embedding)" in piped.stdout
    # The built-in GPT's qkv rows are whole heads in order, so DTensor's column-wise style splits it.
    split = orch("check", "plan.engine=fsdp2", "plan.tp=2", cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert "verdict  FITS with fsdp2:" in split.stdout
    # A user's specs that split a weight in fused parts (each part split on its own) cannot be
    # split by DTensor's styles: refused before any worker.
    specs = ('+model.tp_layer_specs=[{patterns: ["^0[.]weight$"], partition_type: column, shape: [2, -1], '
             'partition_dim: 0}, {patterns: ["^3[.]weight$"], partition_type: row}]')
    fused = orch("check", "model=mlp", "data=dataset", "plan.engine=fsdp2", "plan.tp=2", specs, cwd=tmp_path)
    assert fused.returncode == 2
    assert "plan.tp=2: the tensor-parallel layer specs" in fused.stderr and "split fused layers" in fused.stderr
    assert "Fix: set plan.engine=deepspeed (which split fused layers), or plan.tp=1" in fused.stderr
