"""Cluster profiles (`orch calibrate`): the file it writes loads back into the cluster schema, and
`orch check`, `orch tune` and the tracked prediction price plans at its speeds; where it may be
written. The measurement itself runs on Ray in tests/test_tune_e2e.py and, across two nodes, in
tests/test_cluster.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers.config import compose_config
from helpers.orch_command import orch_run
from orch.checking import checked_run
from orch.cluster_profile import PROFILE_HEADER, check_profile_file, profile_text
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.spec import ClusterSpec, MeasuredSpeeds, Precision
from orch.plans.step_time.cost_model import Speeds
from orch.plans.step_time.phases import PHASES_VERSION
from orch.plans.step_time.prediction import declared_plan_step
from orch.plans.step_time.profile import cluster_speeds, measured_section, mfu_peak, profile_speeds


def _measured(cluster: ClusterSpec, precision: Precision = Precision.fp32, **changes) -> MeasuredSpeeds:
    """A measured section whose speeds differ from the declared ones: matmuls at two heights, a
    faster copy, a slower link (inputs to the pricing, not a measurement)."""
    declared = Speeds.declared(cluster, precision)
    values = {"matmul_tflops": ((64, 0.02), (512, 0.2)), "device_memory_gb_per_s": 40.0, "intra_node_gbps": 4.0,
              "memory_efficiency": 1.0, "intra_bus_efficiency": 1.0, "intra_all_gather_share": 0.3,
              "intra_reduce_scatter_share": 0.25, "sm_count": 0, "source": "measured", **changes}
    speeds = dataclasses.replace(declared, **values)
    return measured_section(speeds, precision=precision, matmul_shape=(256, 1024), measured_at="2026-01-02T03:04:05Z",
                            hosts=["a", "a"], nodes=1, versions={"torch": "x"},
                            sources={"inter_node_gbps": "declared (one node: nothing crosses nodes)"})


def _load(text: str) -> ClusterSpec:
    """A profile file composed as Hydra composes a cluster option: its values over the schema."""
    values = OmegaConf.create(text)
    values.pop("defaults")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterSpec), values))


def test_a_profile_loads_back_into_the_cluster_schema_and_prices_the_plan_at_its_speeds(tmp_path):
    typed, model_cfg, _ = to_typed(compose_config("plan.micro_batch_size=4"))
    measured = _measured(typed.cluster)
    path = tmp_path / "cluster" / "lab.yaml"
    text = profile_text(typed.cluster, measured, path)
    assert text.startswith(PROFILE_HEADER) and f"--config-dir {tmp_path} cluster=lab" in text
    loaded = _load(text)
    assert loaded.measured == measured and loaded.address is None
    assert dataclasses.replace(loaded, measured=None) == typed.cluster

    speeds, note = cluster_speeds(loaded, Precision.fp32)
    assert speeds == profile_speeds(measured) and speeds.source == "measured"
    assert speeds.matmul_tflops == ((64, 0.02), (512, 0.2)) and speeds.tflops_at(100) == 0.02
    assert (speeds.intra_all_gather_share, speeds.intra_reduce_scatter_share) == (0.3, 0.25)
    assert note.startswith("measured by `orch calibrate` at 2026-01-02T03:04:05Z on 1 node(s), 2 worker(s)")
    estimate, facts, probe, _ = checked_run(typed, model_cfg)
    declared = declared_plan_step(estimate.plan, typed.cluster, typed.optim, probe, facts.param_count)
    profiled = declared_plan_step(estimate.plan, loaded, typed.optim, probe, facts.param_count)
    assert profiled.total_s != pytest.approx(declared.total_s, rel=0.01)
    assert profiled.memory_s < declared.memory_s  # the profile's faster copy

    # Another precision's matmul rates do not apply: the declared speeds, and a note saying why.
    speeds, note = cluster_speeds(loaded, Precision.bf16)
    assert speeds == Speeds.declared(loaded, Precision.bf16)
    assert "measured in fp32, the plan trains in bf16 (`orch calibrate plan.precision=bf16`" in note


def test_a_runs_mfu_is_over_the_profiles_fastest_matmul_in_its_precision():
    """The workers' own start-up probe only where the profile timed no matmul in the plan's
    precision (fp8 matmuls are reported against the bf16 peak, as torchtitan's MFU is)."""
    cluster = ClusterSpec()
    assert mfu_peak(cluster, Precision.fp32) == (None, "measured by each worker as it started")
    profiled = dataclasses.replace(cluster, measured=_measured(cluster))
    peak, source = mfu_peak(profiled, Precision.fp32)
    assert peak == 0.2 and source == "the cluster profile's fastest matmul (orch calibrate, 2026-01-02T03:04:05Z)"
    peak, source = mfu_peak(profiled, Precision.bf16)
    assert peak is None and source.endswith("(the cluster profile's matmuls were timed in fp32)")
    bf16 = dataclasses.replace(cluster, measured=_measured(cluster, Precision.bf16))
    assert mfu_peak(bf16, Precision.fp8)[0] == 0.2
    broken = dataclasses.replace(bf16.measured, matmul_tflops=[dataclasses.replace(bf16.measured.matmul_tflops[0],
                                                                                     tflops=float("nan"))])
    assert mfu_peak(dataclasses.replace(cluster, measured=broken), Precision.bf16)[0] is None


def test_a_profile_that_cannot_price_a_plan_is_refused_naming_the_field():
    cluster = ClusterSpec()
    for bad in ({"device_memory_gb_per_s": 0.0}, {"intra_latency_s": float("nan")},
                {"matmul_tflops": ((64, -1.0),)}):
        broken = dataclasses.replace(cluster, measured=_measured(cluster, **bad))
        with pytest.raises(PlanError) as refused:
            cluster_speeds(broken, Precision.fp32)
        [violation] = refused.value.violations
        assert violation.field == "cluster.measured" and "orch calibrate" in violation.fix, violation


def test_orch_check_uses_a_profile_from_the_config_dir(tmp_path):
    """The path a user takes: the profile in ./tuned_plans/cluster/, selected with --config-dir."""
    typed, _, _ = to_typed(compose_config())
    profile = tmp_path / "tuned_plans" / "cluster" / "lab.yaml"
    profile.parent.mkdir(parents=True)
    profile.write_text(profile_text(typed.cluster, _measured(typed.cluster, attention_share=0.5), profile))
    done = orch_run(["check", "--json", "--config-dir", "tuned_plans", "cluster=lab"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    step = json.loads(done.stdout)["predicted_step"]
    assert step["speeds"].startswith("measured by `orch calibrate` at 2026-01-02T03:04:05Z"), step
    # The attention rate it measured is said with the prediction it priced.
    assert step["assumes"] == ["attention at 0.5 of the matmul rate (the cluster profile's measurement)"]


@pytest.mark.parametrize(("overrides", "field", "says"), [
    (("calibrate.name=../up",), "calibrate.name", "is not a plain name"),
    (("calibrate.name=a100_8x",), "calibrate.name", "names a cluster shipped with orch"),
    (("calibrate.out=s3://bucket/cluster/x.yaml",), "calibrate.out", "is a URI"),
    (("calibrate.out={package}/conf/cluster/x.yaml",), "calibrate.out", "is inside the installed orch package"),
    (("calibrate.out={tmp}/mine.yaml",), "calibrate.out", "orch calibrate did not write"),
    (("calibrate.out={tmp}",), "calibrate.out", "is a directory"),
])
def test_where_a_profile_may_not_be_written(tmp_path, monkeypatch, overrides, field, says):
    import orch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("nodes: 4\n")
    package = Path(orch.__file__).resolve().parent
    typed, _, _ = to_typed(compose_config(*(o.format(tmp=tmp_path, package=package) for o in overrides)))
    with pytest.raises(PlanError) as refused:
        check_profile_file(typed)
    [violation] = refused.value.violations
    assert violation.field == field and says in violation.message, violation
    assert (tmp_path / "mine.yaml").read_text() == "nodes: 4\n"


def test_a_profile_orch_calibrate_wrote_may_be_replaced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typed, _, _ = to_typed(compose_config())
    check_profile_file(typed)  # ./tuned_plans/cluster/calibrated.yaml: nothing there yet
    path = tmp_path / "tuned_plans" / "cluster" / "calibrated.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(profile_text(typed.cluster, _measured(typed.cluster), path))
    check_profile_file(typed)


def test_runs_correct_a_profile_phase_by_phase_by_their_median():
    from orch.plans.spec import PhaseObservation, RunObservation
    from orch.plans.step_time.cost_model import StepTime
    from orch.plans.step_time.phases import applied_scales, scaled_step
    from orch.plans.step_time.profile import run_corrections

    def run(name: str, fb: tuple[float, float], opt: tuple[float, float]) -> RunObservation:
        return RunObservation(run_id=name, plan="p", recorded_at="t", phases_version=PHASES_VERSION, phases=[
            PhaseObservation(phase="forward and backward", predicted_s=fb[0], measured_s=fb[1]),
            PhaseObservation(phase="optimizer step", predicted_s=opt[0], measured_s=opt[1])])

    cluster = ClusterSpec()
    measured = dataclasses.replace(_measured(cluster), runs=[run("a", (1.0, 2.0), (0.1, 0.3)),
                                                             run("b", (1.0, 3.0), (0.1, 0.1)),
                                                             run("c", (1.0, 2.5), (0.0, 0.2))])
    # A phase predicted at 0 (no optimizer time in run c) corrects nothing.
    assert run_corrections(measured) == pytest.approx({"forward and backward": 2.5, "optimizer step": 2.0})
    speeds, note = cluster_speeds(dataclasses.replace(cluster, measured=measured), Precision.fp32)
    assert dict(speeds.phase_scale) == pytest.approx({"forward and backward": 2.5, "optimizer step": 2.0})
    assert "corrected by 3 finished run(s): forward and backward x2.50, optimizer step x2.00" in note
    assert "older split" not in note
    # A run recorded under an older split of the step into phases (its optimizer step held other
    # parts) corrects nothing, and the note says so.
    old = dataclasses.replace(run("d", (1.0, 9.0), (0.1, 9.0)), phases_version=1)
    stale = dataclasses.replace(measured, runs=[*measured.runs, old])
    assert run_corrections(stale) == run_corrections(measured)
    _, note = cluster_speeds(dataclasses.replace(cluster, measured=stale), Precision.fp32)
    assert "corrected by 3 finished run(s)" in note and "1 recorded run(s) priced under an older split" in note

    step = StepTime(compute_s=1.0, memory_s=0.5, bubble_s=0.0, tp_comm_s=0.0, dp_comm_s=0.5, pp_comm_s=0.0,
                    offload_s=0.25, optimizer_s=0.25, tokens_per_s=100.0, tflops_per_device=1.0)
    scales = dict(speeds.phase_scale)
    applied = applied_scales(scales, "engine=deepspeed zero_stage=1 offload_optimizer=none", pipelined=False)
    assert applied == scales  # no run recorded its kind: every plan takes every run's
    scaled = scaled_step(step, applied)
    assert (scaled.compute_s, scaled.memory_s, scaled.dp_comm_s) == pytest.approx((2.5, 1.25, 1.25))
    assert (scaled.offload_s, scaled.optimizer_s, scaled.total_s) == pytest.approx((0.5, 0.5, 6.0))
    assert scaled.tokens_per_s == pytest.approx(100.0 * 2.5 / 6.0)
    # No run timed a pipeline schedule: a pipelined plan takes the same parts' corrections.
    assert applied_scales(scales, "k", pipelined=True) == applied
    # Runs that did correct the whole schedule: every part by its one scale, for either kind of plan.
    for pipelined in (True, False):
        schedule = scaled_step(step, applied_scales({"pipeline schedule": 2.0}, "k", pipelined=pipelined))
        assert schedule.total_s == pytest.approx(2 * step.total_s)


def test_a_plan_takes_the_corrections_of_the_runs_of_its_kind_else_of_every_run():
    """Reference runs of several engine settings: each kind's plans take that kind's median, a kind
    no run trained takes the median over all of them, group by group."""
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.spec import Accelerator, Offload, PhaseObservation, RunObservation
    from orch.plans.step_time.phases import applied_scales, correction_kind
    from orch.plans.step_time.prediction import plan_corrections
    from orch.plans.step_time.profile import run_corrections

    def plan(**changes) -> ResolvedPlan:
        values = dict(dp=2, tp=1, pp=1, world_size=2, zero_stage=1, offload_optimizer=Offload.none,
                      offload_param=Offload.none, nvme_path=None, activation_checkpointing=False, micro_batch_size=4,
                      grad_accum_steps=1, precision=Precision.fp32, accelerator=Accelerator.cpu)
        return ResolvedPlan(**{**values, **changes})

    zero1, zero3 = plan(), plan(zero_stage=3)
    offloaded = plan(offload_optimizer=Offload.cpu)
    assert correction_kind(zero1) == "engine=deepspeed zero_stage=1 offload_optimizer=none"
    assert correction_kind(offloaded) == "engine=deepspeed zero_stage=1 offload_optimizer=cpu"

    def run(name: str, kind: str, fb: float, opt: float | None = None) -> RunObservation:
        phases = [PhaseObservation(phase="forward and backward", predicted_s=1.0, measured_s=fb)]
        if opt is not None:
            phases.append(PhaseObservation(phase="optimizer step", predicted_s=1.0, measured_s=opt))
        return RunObservation(run_id=name, plan="p", recorded_at="t", phases=phases, kind=kind, reference=True,
                              phases_version=PHASES_VERSION)

    cluster = ClusterSpec()
    measured = dataclasses.replace(_measured(cluster), runs=[
        run("a", correction_kind(zero1), 1.2, 8.0), run("b", correction_kind(zero1), 1.4),
        run("c", correction_kind(zero3), 2.0, 4.0)])
    corrections = run_corrections(measured)
    assert corrections["forward and backward"] == pytest.approx(1.4)  # of a, b and c
    assert corrections["optimizer step"] == pytest.approx(6.0)
    speeds, _ = cluster_speeds(dataclasses.replace(cluster, measured=measured), Precision.fp32)
    assert plan_corrections(zero1, speeds) == pytest.approx({"forward and backward": 1.3, "optimizer step": 8.0})
    assert plan_corrections(zero3, speeds) == pytest.approx({"forward and backward": 2.0, "optimizer step": 4.0})
    # No run of its kind: the median over every run, each group on its own.
    assert plan_corrections(offloaded, speeds) == pytest.approx({"forward and backward": 1.4, "optimizer step": 6.0})
    assert plan_corrections(zero1, Speeds.declared(cluster)) == {}
    assert applied_scales(dict(speeds.phase_scale), correction_kind(zero3), pipelined=True) == \
        plan_corrections(zero3, speeds)

    # The range of a corrected prediction: each run predicted with the other runs' corrections.
    from orch.plans.step_time.profile import held_out_ratios, runs_range

    assert held_out_ratios(measured) == pytest.approx([9.2 / 5.4, 1.4 / 1.2, 6.0 / 9.3])
    ratios = runs_range(measured)
    low, mid, high = sorted([9.2 / 5.4, 1.4 / 1.2, 6.0 / 9.3])  # interpolated between the sorted ratios
    assert (ratios.p10, ratios.p90, ratios.cases) == pytest.approx((low + 0.2 * (mid - low), high - 0.2 * (high - mid),
                                                                    3)), ratios
    assert "each predicted with the other runs' corrections" in ratios.source
    one = runs_range(dataclasses.replace(measured, runs=measured.runs[:1]))
    assert one.p10 is None and "too few for a P10-P90" in one.source


def test_reference_runs_are_the_declared_plan_under_each_engine_setting_and_bad_ones_are_refused():
    """calibrate.references: each entry changes the declared plan's engine keys (reset first, so a
    reference is the same kind whatever the declared engine); a key no plan has, a value it cannot
    take, too few steps or no tracking store to read the runs back from are refused by name."""
    from orch.plans.spec import Offload
    from orch.reference_runs import reference_plans

    typed, _, _ = to_typed(compose_config("plan.zero_stage=3", "plan.offload_optimizer=cpu", "plan.micro_batch_size=2",
                                          "calibrate.references=[{engine:fsdp2},{zero_stage:1}]"))
    fsdp2, zero1 = reference_plans(typed)
    assert (fsdp2.plan.engine, fsdp2.plan.zero_stage, fsdp2.plan.offload_optimizer) == ("fsdp2", 0, Offload.none)
    assert (zero1.plan.engine, zero1.plan.zero_stage, zero1.plan.offload_optimizer) == ("deepspeed", 1, Offload.none)
    assert zero1.plan.micro_batch_size == 2 and zero1.label == "zero_stage=1"
    assert reference_plans(to_typed(compose_config("calibrate.references=[]"))[0]) == []
    # Unset (null, so that composing a config builds no list): every engine setting the tuner searches.
    defaults = reference_plans(to_typed(compose_config())[0])
    assert [r.label for r in defaults] == ["engine=deepspeed zero_stage=0", "engine=deepspeed zero_stage=1",
                                           "engine=deepspeed zero_stage=2", "engine=deepspeed zero_stage=3",
                                           "engine=deepspeed zero_stage=2 offload_optimizer=cpu", "engine=fsdp2"]

    for overrides, field, says in (
            (["calibrate.references=[{zero_stages:1}]"], "calibrate.references[0]", "zero_stages"),
            (["calibrate.references=[{zero_stage:1},{offload_optimizer:disk}]"], "calibrate.references[1]", "disk"),
            (["calibrate.reference_steps=3"], "calibrate.reference_steps", "below 4"),
            (["tracking.enabled=false"], "tracking.enabled", "read back from the tracking store")):
        with pytest.raises(PlanError) as refused:
            reference_plans(to_typed(compose_config(*overrides))[0])
        [violation] = refused.value.violations
        assert violation.field == field and says in str(refused.value), str(refused.value)


def test_a_run_compares_its_steps_with_the_prediction_only_when_priced_at_measured_speeds():
    """The top of the prediction's P10-P90 range is what a run's steps may take before they are named
    slower than the plan (:mod:`orch.tracking.plan_slowdown`): only at the profile's measured speeds."""
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.spec import Accelerator, Offload
    from orch.plans.step_time.cost_model import StepTime
    from orch.plans.step_time.ranges import ratio_range
    from orch.run.prepare import slowdown_ratio

    plan = ResolvedPlan(dp=2, tp=1, pp=1, world_size=2, zero_stage=1, offload_optimizer=Offload.none,
                        offload_param=Offload.none, nvme_path=None, activation_checkpointing=False,
                        micro_batch_size=4, grad_accum_steps=1, precision=Precision.fp32, accelerator=Accelerator.cpu)
    step = StepTime(compute_s=1.0, memory_s=0.5, bubble_s=0.0, tp_comm_s=0.0, dp_comm_s=0.5, pp_comm_s=0.0,
                    offload_s=0.0, optimizer_s=0.25, tokens_per_s=100.0, tflops_per_device=1.0)
    cluster = ClusterSpec()
    assert slowdown_ratio(step, plan, cluster) is None  # declared speeds: the cost model alone
    measured = dataclasses.replace(cluster, measured=_measured(cluster))
    assert slowdown_ratio(step, plan, measured) == pytest.approx(ratio_range("measured", "cpu").p90)
    assert 1.5 < slowdown_ratio(step, plan, measured) < 3
