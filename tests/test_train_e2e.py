"""Real 2-worker DeepSpeed training inside Ray actors, tracked in a real local MLflow store."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from helpers.config import FAST, compose_config
from orch.config import to_typed
from orch.run.driver import run_training

pytestmark = pytest.mark.slow

MATRIX = [
    # (overrides, why this combination)
    (["plan.zero_stage=0", "model._target_=faulty_models.SlowRankGPT", "data=dataset",
      "data.dataset._target_=faulty_models.SlowRankTokens", "~data.dataset.features", "~data.dataset.classes",
      "+data.dataset.slow_samples=100", "+data.dataset.delay_s=0.05", "train.steps=50"],
     "plain data parallel, fp32, rank 1 a straggler in its data, then in its forward"),
    (["plan.zero_stage=1", "plan.precision=bf16"], "sharded optimizer states, bf16"),
    # ZeRO-2 with CPU Adam offload trains in test_mlflow_run_holds_params_metrics_and_artifacts,
    # which makes these assertions on its run too.
    # ZeRO-3 in fp32 without offload trains (and resumes) in test_reliability's planted-pickle test.
    (["plan=zero3_offload"], "ZeRO-3 + CPU offload + checkpointing + bf16 (shipped plan)"),
    (["plan.zero_stage=1", "plan.activation_checkpointing=true", "plan.grad_accum_steps=2",
      "optim=sgd"], "accumulation, SGD, recompute"),
]


def train(sqlite_uri: str, *overrides: str):
    cfg = compose_config(*FAST, f"tracking.uri={sqlite_uri}", *overrides)
    return run_training(*to_typed(cfg))


def assert_trains_as_data_parallel(result, overrides) -> None:
    steps = 50 if "train.steps=50" in overrides else 30
    assert [r[0].step for r in result.reports] == list(range(5, steps + 1, 5))
    first, last = result.reports[0], result.reports[-1]
    # The loss falls: from ~ln(256)=5.5 at the start to well below after 30 steps.
    assert last[0].loss < first[0].loss - 0.5, (first[0].loss, last[0].loss)
    for reports in result.reports:
        # Ranks agree on the all-reduced loss but computed it on different data.
        assert reports[0].loss == reports[1].loss
        assert reports[0].local_loss != reports[1].local_loss
    assert first[0].first_batch_digest != first[1].first_batch_digest
    assert last[0].evaluation["eval_loss"] == last[1].evaluation["eval_loss"]
    if any("zero_stage=3" in o or "zero3" in o for o in overrides):
        # Built under zero.Init: no rank ever held the whole model, not even while building it.
        assert all(f.model.built == "zero.Init" for f in result.worker_facts)
        assert all(0 < f.model.params_at_build < result.model.param_count for f in result.worker_facts)


@pytest.mark.parametrize("overrides", [m[0] for m in MATRIX], ids=[m[1] for m in MATRIX])
def test_training_matrix(local_ray, sqlite_uri, overrides):
    result = train(sqlite_uri, *overrides)
    assert_trains_as_data_parallel(result, overrides)
    if "model._target_=faulty_models.SlowRankGPT" in overrides:
        assert_the_straggler_is_named(result, sqlite_uri)


def assert_the_straggler_is_named(result, sqlite_uri: str) -> None:
    """Rank 1 draws each of its first 100 samples (25 steps) 0.05 s slower, then its forward is 0.2 s
    slower: named twice, first waiting for its data, then in its forward (never rank 0, which waits
    for it in the backward), with every rank's phases tracked. (Both delays are 0.2 s a step: on a
    machine another test shares, the ranks' median step grows and a smaller excess falls under the
    threshold's share of it, as a 0.1 s forward did beside the 4-worker pipeline tests.)"""
    data, compute = result.stragglers
    # Over the median of two ranks, their mean: half of the 0.2 s rank 1 loses per step.
    assert (data.rank, data.phase) == (1, "data_wait") and data.excess_s > 0.07, data
    assert (compute.rank, compute.phase) == (1, "forward") and compute.excess_s > 0.07, compute
    # Three reports in a row (every 5 steps): the first may still be warming up either rank, and on a
    # machine another test shares (the slow tier runs two files at once) the second too.
    assert data.first_step in (5, 10, 15) and data.last_step == data.first_step + 10, data
    assert data.last_step < compute.first_step and compute.first_step in (30, 35, 40), compute
    assert compute.last_step == compute.first_step + 10, compute
    assert data.message().startswith("rank 1 on ") and "is a straggler: data wait +" in data.message()
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(result.run_id)
    assert run.data.tags["straggler.1"] == data.message() and run.data.tags["straggler.2"] == compute.message()
    assert run.data.metrics["step_phase/rank1/forward_s"] > run.data.metrics["step_phase/rank0/forward_s"] + 0.05
    # orch report's heatmap of the ranks' phases, logged with the run's plots.
    plots = {a.path for a in MlflowClient(tracking_uri=sqlite_uri).list_artifacts(result.run_id, "plots")}
    assert "plots/ranks.png" in plots


def test_mlflow_run_holds_params_metrics_and_artifacts(local_ray, sqlite_uri):
    """What a run leaves in MLflow; its run is also the matrix's ZeRO-2 + CPU Adam offload case, and
    one shorter than the hardware sampling interval (set far above any run's length, so that the
    case holds on a machine of any speed)."""
    plan = ("plan.zero_stage=2", "plan.offload_optimizer=cpu")
    result = train(sqlite_uri, *plan, "tracking.experiment=readback", "tracking.run_name=rb",
                   "tracking.system_metrics_interval_s=3600")
    assert_trains_as_data_parallel(result, plan)
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "rb"
    params = run.data.params
    assert params["plan.zero_stage"] == "2" and params["plan.dp"] == "2" and params["plan.world_size"] == "2"
    assert params["model.n_layer"] == "2" and params["train.steps"] == "30"
    assert int(params["model.param_count"]) == result.model.param_count
    assert params["cluster.address"] == "embedded"
    # Speeds the cluster leaves unset: the defaults the cost model takes, not "None".
    speeds = ("device_tflops", "intra_node_gbps", "inter_node_gbps", "host_link_gbps", "device_memory_gb_per_s",
              "host_memory_gb_per_s")
    assert params["cluster.device_tflops"] == "0.1" and all(params[f"cluster.{s}"] != "None" for s in speeds)
    assert run.data.tags["cluster.speeds_defaulted"].startswith("cpu defaults: device_tflops, ")
    assert not any(k.lower().startswith(("env", "environ")) for k in params)
    assert run.data.tags["world_size"] == "2" and run.data.tags["devices"] == "2xcpu"
    assert run.data.tags["nodes_used"] == "1"
    for key in ("loss", "lr", "tokens_per_s", "samples_per_s", "step_time_s", "tflops_per_device", "mfu"):
        history = client.get_metric_history(result.run_id, key)
        assert [m.step for m in history] == [5, 10, 15, 20, 25, 30], key
    losses = [m.value for m in client.get_metric_history(result.run_id, "loss")]
    assert losses == pytest.approx([r[0].loss for r in result.reports])
    assert [m.step for m in client.get_metric_history(result.run_id, "eval_loss")] == [30]
    # MFU against the matmul peak the workers measured as they started (a tag): near or below 1
    # on a quiet machine, but a peak measured while another test held the cores reads low (CI saw
    # 2.9 and 4.65), so the bound only rules out a wrong unit (1000x); the ratio itself is exact.
    # (With a cluster profile, its rate: tests/test_tune_e2e.py.)
    assert run.data.tags["peak_tflops_source"] == "measured by each worker as it started"
    peak = float(run.data.tags["peak_tflops_per_device"])
    assert run.data.metrics["mfu"] == pytest.approx(run.data.metrics["tflops_per_device"] / peak, rel=1e-3)
    assert 0 < run.data.metrics["mfu"] < 50
    # Every run samples each node's hardware at least once, at its end: a short one has its plot too;
    # and it times the phases of its steps, drawn against their prediction.
    # (plots/ranks.png too when the ranks' phases happened to differ: tests/test_stragglers.py)
    assert {a.path for a in client.list_artifacts(result.run_id, "plots")} - {"plots/ranks.png"} == {
        "plots/loss.png", "plots/throughput.png", "plots/memory.png", "plots/system.png", "plots/step_time.png"}
    assert [m.step for m in client.get_metric_history(result.run_id, "step_phase/backward_s")] == [
        5, 10, 15, 20, 25, 30]
    assert run.data.metrics["memory/rank1/measured_peak_bytes"] > 0
    nodes = sorted(tag.removeprefix("system.") for tag in run.data.tags if tag.startswith("system.node"))
    assert nodes == ["node0"], run.data.tags
    for metric in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
        history = client.get_metric_history(result.run_id, f"system/node0/{metric}")
        # One sample: the one taken as the node's training ended (at its last step), none before it was due.
        assert [m.step for m in history] == [30], (metric, history)
        assert history[0].value > 0
    # Where the time before the first report went, phase by phase.
    assert list(result.startup) == ["check", "tracking", "ray", "workers", "setup", "first_report"]
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("startup/")} == pytest.approx(
        {f"startup/{phase}_s": seconds for phase, seconds in result.startup.items()})
    assert all(seconds >= 0 for seconds in result.startup.values())
    assert 0 < result.time_to_first_report_s < result.wall_s  # the phases' sum, by construction
    assert result.startup["setup"] > 0 and result.startup["first_report"] > 0
    assert {a.path for a in client.list_artifacts(result.run_id, "plan")} == {
        "plan/estimate.json", "plan/placement.json", "plan/placement_realized.json"}
    artifacts = {a.path for a in client.list_artifacts(result.run_id, "config")}
    assert artifacts == {"config/resolved.yaml", "config/deepspeed.json", "config/optimizer.json"}
    import json

    with open(client.download_artifacts(result.run_id, "config/deepspeed.json")) as f:
        ds = json.load(f)
    with open(client.download_artifacts(result.run_id, "config/optimizer.json")) as f:
        optim = json.load(f)
    assert ds["zero_optimization"]["stage"] == 2
    # The DeepSpeed JSON serializes the engine-neutral settings the run logged beside it.
    assert optim["optimizer"]["name"] == "adamw" and ds["optimizer"]["type"] == "AdamW"
    assert {k: v for k, v in optim["schedule"].items() if k != "type"} == ds["scheduler"]["params"]
    assert optim["grad_clip"] == ds["gradient_clipping"]


def test_a_failing_worker_fails_the_run_cleanly(local_ray, sqlite_uri):
    import time

    import ray

    from orch.launchers.worker_group import WorkerFailedError

    with pytest.raises(WorkerFailedError) as info:
        train(sqlite_uri, "model._target_=faulty_models.ExplodingGPT", "tracking.run_name=exploding")
    assert "RuntimeError: boom: deliberately broken model" in str(info.value)
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id],
                             filter_string="attributes.run_name = 'exploding'")[0]
    assert run.info.status == "FAILED"
    # Nothing leaks: every placement group is removed and every CPU is free again.
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "worker actors still hold resources"
        time.sleep(0.5)


def test_selective_and_full_recomputation_train_as_keeping_everything_does(local_ray, sqlite_uri):
    """Recomputation changes what a step keeps, not what it computes: none, selective (matmul and
    attention outputs kept, the rest recomputed under torch's selective-checkpoint contexts), full
    of every 2nd block (blocks 0 and 2 of the GPT's four) and full give the same losses on the same
    data, in fp32; and the memory probe measures the peak falling in that order, as the planner
    predicts it. (With two blocks, every 2nd is the first alone, and the step's peak, at the start of
    the backward through the last block, is full's: the last block's activations are held either way.)"""
    policies = {"none": "none", "selective": "selective", "full/2": "full plan.recompute_every_n_layers=2",
                "full": "full"}
    runs = {name: train(sqlite_uri, "train.steps=10", "train.log_every=5", "plan.zero_stage=1", "model.n_layer=4",
                        *f"plan.activation_checkpointing={policy}".split(), "train.export=false",
                        f"tracking.run_name=recompute-{name.replace('/', '-every-')}")
            for name, policy in policies.items()}
    assert runs["full/2"].plan.recompute_every_n_layers == 2
    losses = {name: [r[0].loss for r in result.reports] for name, result in runs.items()}
    for name in ("selective", "full/2", "full"):
        assert losses[name] == pytest.approx(losses["none"], rel=1e-5, abs=1e-6), name
    peaks = {name: max(r.measured_peak_bytes for reports in result.reports for r in reports
                       if r.measured_peak_bytes is not None) for name, result in runs.items()}
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    assert peaks["none"] > peaks["full/2"] > peaks["full"], peaks
    predicted = {name: result.estimate.per_device.activations for name, result in runs.items()}
    assert predicted["none"] > predicted["selective"] > predicted["full"], predicted
    assert predicted["none"] > predicted["full/2"] > predicted["full"], predicted
