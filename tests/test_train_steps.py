"""The pure decisions of a training run: which failed attempts restart, and what a logged step
records (milliseconds; the real restarts are tests/test_reliability.py's)."""

from __future__ import annotations

import dataclasses

import pytest
from ray.exceptions import RayActorError

from orch.launchers.job import PollStatus, StepReport
from orch.launchers.worker_group import WorkerFailedError, WorkerHangError, hang_culprits
from orch.plans.errors import PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.spec import ClusterSpec, PlanSpec, TrainSpec
from orch.run.driver import FailurePolicy
from orch.tracking.step_metrics import MeasurementsOnce, step_metrics


@pytest.mark.parametrize("error", [WorkerFailedError(1, "Traceback ..."), WorkerHangError([0], "stuck", {}),
                                   RayActorError()])
def test_worker_failures_restart_until_max_failures_are_used(error):
    policy = FailurePolicy(max_failures=2)
    assert [policy.gives_up(error, failures) for failures in (1, 2, 3)] == [False, False, True]


@pytest.mark.parametrize("error", [PlanError([]), ValueError("a bug in the driver")])
def test_anything_else_ends_the_run_at_once(error):
    assert FailurePolicy(max_failures=5).gives_up(error, 1)


def test_a_step_is_as_slow_as_its_slowest_rank_and_counts_each_replicas_tokens_once():
    plan = resolve_plan(PlanSpec(dp=2, tp=2, micro_batch_size=4), ClusterSpec(devices_per_node=4), TrainSpec())
    reports = [StepReport(rank=r, step=10, loss=2.0, local_loss=2.0 + r, lr=1e-3, epoch=1, step_time_s=0.5 + 0.1 * r,
                          samples_per_s=8.0, tokens_per_s=1000.0, first_batch_digest="",
                          evaluation={"eval_loss": 1.5, "eval_accuracy": 0.25}) for r in range(4)]
    metrics = step_metrics(reports, plan, flops_per_sample=10**9, peak_tflops=0.0)
    assert metrics["step_time_s"] == pytest.approx(0.8) and metrics["step_time_spread_s"] == pytest.approx(0.3)
    assert metrics["samples_per_s"] == pytest.approx(plan.global_batch_size / 0.8)
    assert metrics["tokens_per_s"] == pytest.approx(2000.0)  # 4 ranks, 2 replicas: each replica's tokens once
    assert metrics["tflops_per_device"] == pytest.approx(1e9 * plan.global_batch_size / 0.8 / 4 / 1e12)
    assert "mfu" not in metrics  # no measured peak, no utilization
    assert (metrics["eval_loss"], metrics["eval_accuracy"], metrics["epoch"]) == (1.5, 0.25, 1)


def test_a_report_names_its_values_for_a_sweep_and_carries_memory_only_when_measured():
    report = StepReport(rank=0, step=4, loss=2.0, local_loss=2.5, lr=1e-3, epoch=0, step_time_s=0.5,
                        samples_per_s=16.0, tokens_per_s=None, first_batch_digest="ab",
                        evaluation={"eval_loss": 1.5})
    assert report.named_values() == {"loss": 2.0, "local_loss": 2.5, "lr": 1e-3, "step_time_s": 0.5,
                                     "samples_per_s": 16.0, "epoch": 0, "eval_loss": 1.5}
    plan = resolve_plan(PlanSpec(dp=1, micro_batch_size=4), ClusterSpec(devices_per_node=1), TrainSpec())
    metrics = step_metrics([report], plan, flops_per_sample=10**9, peak_tflops=1.0)
    assert "tokens_per_s" not in metrics and not any(key.startswith("memory/") for key in metrics)
    probed = dataclasses.replace(report, measured_peak_bytes=300, measured_state_bytes=100)
    measured = step_metrics([probed], plan, flops_per_sample=10**9, peak_tflops=1.0)
    assert measured["memory/rank0/measured_peak_bytes"] == 300 and measured["memory/measured_state_bytes"] == 100


def test_a_memory_measurement_is_tracked_once_and_again_only_when_it_changes():
    once = MeasurementsOnce()
    probed = {"loss": 2.0, "memory/measured_peak_bytes": 300.0, "memory/rank0/measured_peak_bytes": 300.0}
    assert once.fresh(probed) == probed
    assert once.fresh({**probed, "loss": 1.5}) == {"loss": 1.5}
    remeasured = {**probed, "memory/measured_peak_bytes": 310.0}
    assert once.fresh(remeasured) == {"loss": 2.0, "memory/measured_peak_bytes": 310.0}


def test_a_hang_names_the_ranks_the_others_wait_for_even_before_they_time_out():
    def poll(milestones: int, done: bool = False) -> PollStatus:
        return PollStatus(reports=[], done=done, error=None, step=3, milestones=milestones, since_progress_s=5.0)

    # Rank 0 finished its forward and waits in backward's all-reduce; rank 1 is stuck in its forward.
    assert hang_culprits([poll(13), poll(12)]) == [1]
    assert hang_culprits([poll(12), poll(12), poll(13)]) == [0, 1]
    assert hang_culprits([poll(5, done=True), poll(12), poll(13)]) == [1]  # a finished rank waits for nothing


def test_system_metrics_continue_the_runs_steps_after_a_restart():
    """Each node's samples are logged at the training step its sampling rank had reached, never
    before the attempt's first: a restarted attempt (or a resumed run) does not log from step 0 again."""
    from types import SimpleNamespace

    from orch.tracking.train_run import SystemMetricsLog

    class Recorded:  # the two calls SystemMetricsLog makes of the run's tracker
        def __init__(self):
            self.metrics, self.tags = [], {}

        def log_metrics(self, metrics: dict, step: int) -> None:
            self.metrics += [(name, step) for name in metrics]

        def set_tags(self, tags: dict) -> None:
            self.tags.update(tags)

    tracker = Recorded()
    facts = [SimpleNamespace(rank=rank, node_id="n", hostname="host", start_step=20) for rank in (0, 1)]
    log = SystemMetricsLog(tracker, facts)
    log(0, [{"cpu": 1.0}], 0)  # sampled before the restarted attempt's first step
    log(0, [{"cpu": 1.0}, {"cpu": 2.0}], 25)
    assert tracker.metrics == [("system/node0/cpu", 20), ("system/node0/cpu", 25), ("system/node0/cpu", 25)]
    assert tracker.tags == {"system.node0": "host"}
