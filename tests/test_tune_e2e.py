"""A real `orch tune tune.trials=2` on 2 Ray workers: one trial fails, tuning goes on, MLflow records it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers.config import compose_config
from orch.config import to_typed
from orch.tune.result import render
from orch.tune.search import tune

pytestmark = pytest.mark.slow

# Two candidates only: micro-batch 4 (one micro-step, ranked first) and micro-batch 2 (two).
# OutOfMemoryAboveTwo fails on a real micro-batch of more than 2 samples, so the first trial fails
# the way an out-of-memory plan does, and the second must still run and win.
SPACE = ["train.global_batch_size=8", "tune.micro_batch_sizes=[2,4]", "tune.engines=[deepspeed]",
         "tune.zero_stages=[1]", "tune.offload=[none]",
         "tune.activation_checkpointing=[false]", "tune.tp=[1]", "tune.pp=[1]", "tune.trials=2",
         "tune.trial_steps=4", "tune.calibrate=false", "model._target_=faulty_models.OutOfMemoryAboveTwo"]


def test_tune_trials_contain_a_failing_plan_and_log_nested_runs(local_ray, sqlite_uri, tmp_path, capsys):
    out = tmp_path / "winner.yaml"
    cfg = compose_config(*SPACE, f"tracking.uri={sqlite_uri}", f"tune.out={out}", "tracking.experiment=tune-e2e")
    typed, model_cfg, _ = to_typed(cfg)
    result = tune(typed, model_cfg)

    first, second = result.trials
    assert first.candidate.plan.micro_batch_size == 4 and first.status == "failed"
    assert "simulated out of memory" in first.error
    assert second.candidate.plan.micro_batch_size == 2 and second.status == "ok"
    assert second.tokens_per_s > 0 and second.step_time_s > 0 and second.peak_bytes > 0
    # The best *measured* plan wins, not the best predicted one (which failed).
    assert result.winner is second.candidate and result.winner_trial is second
    assert "micro_batch_size: 2" in out.read_text() and "grad_accum_steps: 2" in out.read_text()

    client = MlflowClient(tracking_uri=sqlite_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["orch.command"] == "tune"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_trial = {run.data.tags["orch.tune.trial"]: run for run in children}
    assert set(by_trial) == {"1", "2"}
    assert by_trial["1"].info.status == "FAILED" and first.run_id == by_trial["1"].info.run_id
    assert by_trial["2"].info.status == "FINISHED"
    assert by_trial["2"].data.params["plan.micro_batch_size"] == "2"
    assert parent.data.tags["trial.1.status"] == "failed" and "simulated out of memory" in parent.data.tags[
        "trial.1.error"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "tune")}
    assert {"tune/candidates.json", "tune/ranked.txt", "tune/winner.yaml"} <= artifacts
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == ["plots/tune_candidates.png"]
    doc = json.loads(open(client.download_artifacts(parent.info.run_id, "tune/candidates.json",
                                                    str(tmp_path))).read())
    assert doc["best"]["chosen_by"] == "measured" and doc["best"]["plan"]["micro_batch_size"] == 2
    assert doc["candidates"][0]["measured"]["status"] == "failed"
    assert doc["candidates"][1]["measured"]["tokens_per_s"] == pytest.approx(second.tokens_per_s)

    table = render(result, top_k=10)
    assert "failed: RuntimeError" in table or "failed: WorkerFailedError" in table
    assert "winner (best measured)" in table


def test_orch_calibrate_measures_the_workers_writes_a_profile_and_fills_the_tuners_cache(local_ray, tmp_path,
                                                                                          sqlite_uri):
    """`orch calibrate` on the local 2-worker cluster: the profile it writes holds what the probes
    measured (one node: the link across nodes stays declared) and a reference run's phases, which
    correct the plans of its kind; it prices plans once loaded back, and the tuner's calibration
    then reads the same speeds from the cache instead of measuring again."""
    from omegaconf import OmegaConf

    from orch.cluster_profile import calibrate_cluster
    from orch.cluster_profile import render as render_profile
    from orch.plans.spec import ClusterSpec
    from orch.plans.step_time.cost_model import Speeds
    from orch.plans.step_time.profile import cluster_speeds
    from orch.tune.search import measure_speeds, prepare

    cache = tmp_path / "cache"
    typed, model_cfg, _ = to_typed(compose_config(f"tune.cache_dir={cache}", f"tracking.uri={sqlite_uri}",
                                                  "calibrate.references=[{engine:deepspeed,zero_stage:1}]",
                                                  "calibrate.reference_steps=4"))
    profile = calibrate_cluster(typed, model_cfg)
    speeds, declared = profile.speeds, Speeds.declared(ClusterSpec())
    assert speeds.source == "measured" and profile.path == Path("tuned_plans/cluster/calibrated.yaml")
    assert len(profile.measured.hosts) == 2 and profile.measured.nodes == 1
    assert all(tflops > 0 for _, tflops in speeds.matmul_tflops) and len(speeds.matmul_tflops) > 1
    # One node: the all-reduce inside it is measured; across nodes stays declared, and says so.
    assert speeds.intra_node_gbps > 0 and speeds.intra_latency_s > 0
    assert speeds.intra_node_gbps != declared.intra_node_gbps
    # gloo's all-gather and reduce-scatter, timed through the calls FSDP2 and ZeRO make, run below
    # its all-reduce's bus rate; across nodes nothing is measured.
    assert 0 < speeds.intra_all_gather_share < 1 and 0 < speeds.intra_reduce_scatter_share < 1
    assert speeds.inter_all_gather_share == speeds.inter_reduce_scatter_share == 1.0
    assert "all_gather_into_tensor" in profile.measured.sources["intra_all_gather_share"]
    assert speeds.inter_node_gbps == declared.inter_node_gbps
    assert profile.measured.sources["inter_node_gbps"].startswith("declared (one node")
    assert speeds.device_memory_gb_per_s > 0 and speeds.host_memory_gb_per_s >= speeds.device_memory_gb_per_s
    # The GPT's attention, timed at its own shape against the matmuls at the same rows.
    assert 0 < speeds.attention_share < 2
    assert profile.measured.sources["attention_share"].startswith("scaled_dot_product_attention forward and backward")
    text = render_profile(profile)
    assert "all-reduce bus Gbit/s inside a node" in text and "kept as declared" in text
    assert "reduce-scatter bus Gbit/s inside a node" in text and "attention's FLOP rate over the matmuls'" in text
    assert "use it: orch check --config-dir tuned_plans cluster=calibrated" in text
    # The reference run: trained at the profile's speeds, its phases recorded with its kind.
    [outcome] = profile.references
    assert outcome.skipped is None, outcome.skipped
    [run] = profile.measured.runs
    assert run.reference and run.kind == "engine=deepspeed zero_stage=1 offload_optimizer=none"
    assert {phase.phase for phase in run.phases} >= {"forward and backward", "optimizer step"}
    assert all(phase.predicted_s > 0 and phase.measured_s > 0 for phase in run.phases)
    assert "engine=deepspeed zero_stage=1" in text and f"(run {run.run_id})" in text
    # Its last step but one ran under the profiler: its kinds of work against the parts pricing them.
    parts = {part.phase: part for part in run.parts}
    assert parts["compute (matmul, attention)"].predicted_s > 0 and parts["compute (matmul, attention)"].measured_s > 0
    assert "its profiled step by kind of work: compute (matmul, attention) x" in text

    values = OmegaConf.load(profile.path)
    values.pop("defaults")
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterSpec), values))
    assert loaded.measured == profile.measured
    priced, note = cluster_speeds(loaded, typed.plan.precision)
    assert dataclasses.replace(priced, phase_scale=()) == speeds and "corrected by 1 finished run(s)" in note
    fb = next(phase for phase in run.phases if phase.phase == "forward and backward")
    assert dict(priced.phase_scale)[f"{run.kind}: forward and backward"] == pytest.approx(
        fb.measured_s / fb.predicted_s)

    space, ctx = prepare(typed, model_cfg, typed.cluster)
    cached, note = measure_speeds(typed, typed.cluster, space, ctx)
    assert note.startswith("measured speeds from the cache") and cached == speeds
    assert len(list(cache.glob("calibration-*.json"))) == 1

    # A profile claiming ten times the speeds measured here: every rank is slower than the plan
    # predicts, alike, so comparing the ranks names nobody; the plan's prediction does.
    from orch.run.driver import run_training
    from orch.tracking.plan_slowdown import PlanSlowdown

    m = loaded.measured
    boasted = dataclasses.replace(
        m, runs=[], matmul_tflops=[dataclasses.replace(rate, tflops=10 * rate.tflops) for rate in m.matmul_tflops],
        intra_node_gbps=10 * m.intra_node_gbps, host_link_gbps=10 * m.host_link_gbps,
        device_memory_gb_per_s=10 * m.device_memory_gb_per_s, host_memory_gb_per_s=10 * m.host_memory_gb_per_s,
        host_optimizer_params_per_s=10 * m.host_optimizer_params_per_s, intra_latency_s=m.intra_latency_s / 10,
        op_overhead_s=m.op_overhead_s / 10)
    run_cfg, run_model_cfg, run_yaml = to_typed(compose_config(
        f"tracking.uri={sqlite_uri}", "train.steps=12", "train.log_every=3", "train.eval_batches=1",
        "train.export=false", "tracking.run_name=boasted-profile"))
    result = run_training(dataclasses.replace(run_cfg, cluster=dataclasses.replace(loaded, measured=boasted)),
                          run_model_cfg, run_yaml)
    slowdowns = [s for s in result.stragglers if isinstance(s, PlanSlowdown)]
    assert slowdowns and slowdowns[0].measured_s > slowdowns[0].allowed_s > slowdowns[0].predicted_s
    assert slowdowns[0].message().startswith("the step is slower than the plan predicts: ")
    tracked = MlflowClient(sqlite_uri).get_run(result.run_id).data
    assert tracked.tags["straggler.1"] == slowdowns[0].message()
    # Its MFU is over the profile's fastest matmul, not a rate the workers measured under load.
    assert tracked.tags["peak_tflops_source"].startswith("the cluster profile's fastest matmul (orch calibrate, ")
    peak = max(rate.tflops for rate in boasted.matmul_tflops)
    assert float(tracked.tags["peak_tflops_per_device"]) == pytest.approx(peak, rel=1e-3)
    assert tracked.metrics["mfu"] == pytest.approx(tracked.metrics["tflops_per_device"] / peak, rel=1e-6)
