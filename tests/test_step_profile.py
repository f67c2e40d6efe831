"""`train.profile_steps`: a step under torch's profiler, its time by kind of work, its trace in the run.

The summing is checked on a real profile of a real step here; the end-to-end runs (DeepSpeed in
the shared dp=2 reference run, FSDP2 with tensor parallelism in tests/test_fsdp2_e2e.py) check
that every rank's profile reaches the MLflow run.
"""

from __future__ import annotations

import gzip
import json

import pytest

from helpers.config import FAST, compose_config
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan


def test_kinds_of_work_come_from_the_operator_and_what_encloses_it():
    from orch.launchers.step_profile import kind_of

    assert kind_of("aten::mm", []) == kind_of("aten::addmm", ["aten::linear"]) == "matmul"
    assert kind_of("aten::_flash_attention_forward", []) == "attention"
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu", []) == "attention"
    assert kind_of("c10d::allreduce_", []) == kind_of("nccl:all_reduce", []) == "communication"
    assert kind_of("record_param_comms", []) == kind_of("gloo:all_gather", []) == "communication"
    assert kind_of("aten::copy_", []) == kind_of("Memcpy HtoD (Pinned -> Device)", []) == "copies"
    assert kind_of("_c10d_functional::wait_tensor", []) == "communication"  # FSDP2's functional collectives
    assert kind_of("aten::gelu", []) == kind_of("aten::native_layer_norm", []) == "element-wise and other"
    # A framework record's own CPU time is Python: host time. On a device it is kernels it launched itself.
    assert kind_of("FSDP::pre_forward (blocks.0)", []) == kind_of("PythonSubclass", []) == "host"
    # Except FSDP2's collectives' records on CPU: their own time is the wait for gloo's threads.
    assert kind_of("FSDP::all_gather (blocks.0)", []) == kind_of("FSDP::post_backward_reduce", []) == "communication"
    assert kind_of("FSDP::all_gather_copy_out", []) == "host"
    assert kind_of("autograd::engine::evaluate_function: AddmmBackward0", []) == "host"
    assert kind_of("## Call CompiledFxGraph ##", [], device=True) == "element-wise and other"
    # Whatever an optimizer's step runs is the optimizer's, its foreach additions and copies too; the
    # record itself holds the time of an extension's own kernel (DeepSpeed's FusedAdam, CPU Adam).
    assert kind_of("aten::_foreach_add_", ["Optimizer.step#AdamW.step"]) == "optimizer"
    assert kind_of("aten::copy_", ["aten::to", "Optimizer.step#DeepSpeedCPUAdam.step"]) == "optimizer"
    assert kind_of("Optimizer.step#FusedAdam.step", []) == "optimizer"
    assert kind_of("aten::zero_", ["Optimizer.zero_grad#AdamW.zero_grad"]) == "optimizer"
    # Everything in the step's optimizer phase (gradient clipping too) is the optimizer's.
    assert kind_of("aten::linalg_vector_norm", [], phase="optimizer") == "optimizer"
    assert kind_of("aten::mm", [], phase="backward") == "matmul"


def test_an_operator_knows_its_phase_from_the_innermost_phase_range():
    from orch.launchers.step_profile import phase_of

    phases = ["forward", "backward", "optimizer"]
    assert phase_of(["aten::linear", "orch.phase#2", "ProfilerStep"], phases) == "optimizer"
    assert phase_of(["orch.phase#0"], phases) == "forward"
    assert phase_of(["orch.phase#3"], phases) == "other"  # after the last milestone
    assert phase_of(["aten::linear"], phases) == ""


def test_each_operators_own_time_goes_to_its_kind_in_its_phase():
    """torch's events as the profiler hands them over (name, enclosing event, own times, device)."""
    from types import SimpleNamespace

    from orch.launchers.step_profile import time_by_kind

    def event(name, parent=None, cpu_us=0.0, device_us=0.0, device_type="DeviceType.CPU", at=(0.0, 0.0),
              is_async=False):
        return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=cpu_us,
                               self_device_time_total=device_us, device_type=device_type,
                               time_range=SimpleNamespace(start=at[0], end=at[1]), is_async=is_async)

    forward = event("orch.phase#0", cpu_us=5.0, at=(0, 1000))
    backward = event("orch.phase#1", cpu_us=5.0, at=(1000, 2000))
    optimizer_phase = event("orch.phase#2", cpu_us=5.0, at=(2000, 3000))
    fsdp_reduce = event("FSDP::post_backward_reduce", backward, cpu_us=60.0, at=(1500, 1600))
    events = [forward, backward, optimizer_phase, fsdp_reduce,
              event("aten::mm", forward, cpu_us=300.0, device_us=30.0),
              event("aten::mm", optimizer_phase, cpu_us=200.0, device_us=20.0),  # clipping's, say: optimizer
              event("FSDP::pre_forward", forward, cpu_us=100.0),
              event("sm90_xmma_gemm", None, device_us=30.0, device_type="DeviceType.CUDA"),  # its launcher counts it
              # gloo runs a collective on a thread of its own, an asynchronous event with no own time:
              # its duration is the caller's wait (DeepSpeed's, in the backward phase's own time),
              event("gloo:all_reduce", None, at=(1100, 1140), is_async=True),
              # in the optimizer phase the optimizer's (ZeRO-1/2's gather of the updated parameters),
              event("gloo:all_gather", None, at=(2500, 2510), is_async=True),
              # and counted once under FSDP2's records, whose own time is that wait.
              event("gloo:reduce_scatter", None, at=(1510, 1570), is_async=True)]
    phases = ["forward", "backward", "optimizer"]
    assert time_by_kind(events, device=False, phases=phases) == pytest.approx(
        {"matmul": 300e-6, "optimizer": 210e-6, "host": 100e-6, "communication": 100e-6})
    assert time_by_kind(events, device=True, phases=phases) == pytest.approx({"matmul": 30e-6, "optimizer": 20e-6})


def test_a_profiled_step_is_summed_by_kind_of_work_and_keeps_its_trace():
    """A real step (forward with attention, backward, clipping, AdamW) under the real profiler."""
    import torch

    from orch.launchers.step_profile import prepare_profiler, profiled_step, summary

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    prepare_profiler()
    named = []
    with profiled_step(7, torch.device("cpu"), named.append) as profiled:
        attended = torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])[0]
        loss = model(attended).pow(2).mean()
        profiled.milestone("forward")
        loss.backward()
        profiled.milestone("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        profiled.milestone("optimizer")
    assert named == ["forward", "backward", "optimizer"]  # the engine's milestones still reach the worker
    profile, = profiled.profiles
    assert profile.step == 7 and profile.clock == "cpu"
    for kind in ("matmul", "attention", "element-wise and other", "optimizer"):
        assert profile.seconds[kind] > 0, (kind, profile.seconds)
    assert 0 < profile.busy_s <= profile.wall_s
    trace = json.loads(gzip.decompress(profile.trace_gz))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names and any(str(name).startswith("Optimizer.step#AdamW") for name in names)
    assert {"orch.phase#0", "orch.phase#1", "orch.phase#2", "orch.phase#3"} <= names
    assert summary(profile).startswith("step 7 profiled (operator CPU time ")


def test_a_profiled_step_stays_out_of_the_reported_step_time():
    from orch.launchers.step_interval import Interval

    interval = Interval(samples_per_step=4, tokens_per_sample=None)
    interval.add(2.0, 0.1)
    interval.add(4.0, 5.0, timed=False)  # under the profiler
    interval.add(3.0, 0.3)
    assert interval.mean_loss == 3.0 and interval.timed_steps == 2
    assert interval.rates()["step_time_s"] == pytest.approx(0.2)
    interval.reset()
    interval.add(1.0, 5.0, timed=False)  # an interval of the profiled step alone still has a time
    assert interval.rates()["step_time_s"] == 5.0 and interval.timed_steps == 1


def test_a_profiled_steps_kinds_of_work_meet_the_predicted_parts_that_price_them():
    from orch.tracking.step_prediction import compare_parts, most_wrong, profiled_kinds

    metrics = {"profile/matmul_s": 0.08, "profile/attention_s": 0.02, "profile/elementwise_s": 0.05,
               "profile/optimizer_s": 0.03, "profile/copies_s": 0.01, "profile/wall_s": 0.25,
               "profile/rank1/matmul_s": 0.09, "step_phase/forward_s": 0.1}
    kinds = profiled_kinds(metrics)
    assert kinds == {"matmul": 0.08, "attention": 0.02, "elementwise": 0.05, "optimizer": 0.03, "copies": 0.01,
                     "wall": 0.25}
    parts = {"compute": 0.09, "memory": 0.02, "bubble": 0.0, "tp": 0.0, "dp": 0.0, "pp": 0.0, "offload": 0.005,
             "optimizer": 0.01, "zero3_hooks": 0.0}
    rows = compare_parts(parts, kinds)
    # No communication either way: no row for it.
    assert [row.name for row in rows] == ["compute (matmul, attention)", "memory-bound (element-wise, other)",
                                          "optimizer and offload copies"]
    assert [row.predicted_s for row in rows] == pytest.approx([0.09, 0.02, 0.015])
    assert [row.measured_s for row in rows] == pytest.approx([0.10, 0.05, 0.04])
    assert most_wrong(compare_parts(parts, kinds)).name == "memory-bound (element-wise, other)"


def test_a_profile_records_a_runs_parts_without_the_phase_corrections_its_prediction_took():
    """A run priced at a corrected profile logged corrected parts; the profile records them as the
    speeds alone priced them (divided by their phase group's correction), as it does phases."""
    import json

    from orch.tracking.step_prediction import part_comparisons

    params = {"step_time.predicted.total_s": "0.5", "step_time.predicted.compute_s": "0.2",
              "step_time.predicted.memory_s": "0.1", "step_time.predicted.optimizer_s": "0.15",
              "step_time.predicted.phase_scale": json.dumps({"forward and backward": 2.0, "optimizer step": 3.0})}
    metrics = {"profile/matmul_s": 0.12, "profile/elementwise_s": 0.04, "profile/optimizer_s": 0.06,
               "profile/wall_s": 0.3}
    corrected = {row.name: row.predicted_s for row in part_comparisons(params, metrics)}
    uncorrected = {row.name: row.predicted_s for row in part_comparisons(params, metrics, uncorrected=True)}
    assert corrected == pytest.approx({"compute (matmul, attention)": 0.2, "memory-bound (element-wise, other)": 0.1,
                                       "optimizer and offload copies": 0.15})
    assert uncorrected == pytest.approx({"compute (matmul, attention)": 0.1,
                                         "memory-bound (element-wise, other)": 0.05,
                                         "optimizer and offload copies": 0.05})
    assert part_comparisons(params, {"loss": 1.0}) == []  # no step profiled


@pytest.mark.parametrize(("steps", "said"), [
    ("[31]", "train.profile_steps=[31]: step(s) [31] are not among the run's steps 1..30 (train.steps=30). "
             "Fix: name steps from 1 to 30, e.g. train.profile_steps=[30]"),
    ("[0,5]", "train.profile_steps=[0, 5]: step(s) [0] are not among the run's steps 1..30"),
    ("[2]", "train.profile_steps=[2]: step 2 is train.memory_probe_step, whose memory tracker slows the step the "
            "profiler would record. Fix: profile another step (e.g. train.profile_steps=[30]), or move "
            "train.memory_probe_step"),
])
def test_profiled_steps_must_be_steps_of_the_run_and_not_the_memory_probe(steps, said):
    typed, _, _ = to_typed(compose_config(*FAST, f"train.profile_steps={steps}"))
    with pytest.raises(PlanError) as raised:
        resolve_plan(typed.plan, typed.cluster, typed.train)
    assert said in str(raised.value)


@pytest.mark.slow
def test_every_rank_of_a_deepspeed_run_profiles_its_step_into_the_run(dp_reference, dp_reference_uri):
    """The shared dp=2 ZeRO-1 reference run profiles step 7 (conftest): each rank's trace is an
    artifact of the run, the slowest rank's time by kind a metric, and step 7 is out of the
    step time of the report that holds it (steps 6-10)."""
    from mlflow.tracking import MlflowClient

    report = next(reports for reports in dp_reference.reports if reports[0].step == 10)
    assert all(r.steps == 4 for r in report)  # step 7 left out
    profiles = {r.rank: r.profiles for r in report}
    assert sorted(profiles) == [0, 1] and all(len(p) == 1 and p[0].step == 7 for p in profiles.values())
    for (profile,) in profiles.values():
        # Gloo's all-reduce of ZeRO-1's gradients, DeepSpeed's optimizer (its FusedAdam on CPU is torch's AdamW).
        for kind in ("matmul", "communication", "optimizer"):
            assert profile.seconds.get(kind, 0) > 0, (kind, profile.seconds)
    # gloo's collectives count by their duration (their events have no own time; the caller waits
    # in the phase's own time): more than the calls that enqueue them, which were all it counted.
    assert max(p[0].seconds["communication"] for p in profiles.values()) > 1.5e-3, profiles
    client = MlflowClient(dp_reference_uri)
    metrics = client.get_run(dp_reference.run_id).data.metrics
    assert metrics["profile/matmul_s"] > 0 and metrics["profile/rank1/optimizer_s"] > 0
    traces = [a.path for a in client.list_artifacts(dp_reference.run_id, "profile/step7")]
    assert traces == ["profile/step7/rank0.trace.json.gz", "profile/step7/rank1.trace.json.gz"]
    # `orch report`'s step-time lines set the profiled kinds beside the predicted parts.
    from orch.tracking.step_prediction import step_time_lines

    run = client.get_run(dp_reference.run_id)
    lines = step_time_lines(client, dp_reference.run_id, run.data.params, run.data.metrics)
    assert "profiled step 7: the slowest rank's operators' CPU time by kind of work" in "\n".join(lines)
    assert any(line.strip().startswith("compute (matmul, attention)") for line in lines)
    assert lines[-1].startswith("  most wrong part: ")
