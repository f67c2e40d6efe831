"""The metrics of one logged step, computed from every rank's report (what the driver tracks and
shows; no MLflow here, so the driver imports MLflow only when a run is tracked)."""

from __future__ import annotations

import math

from orch.launchers.job import StepReport, WorkerFacts
from orch.plans.resolve import ResolvedPlan
from orch.tracking.step_prediction import PHASE_METRIC


def step_metrics(reports: list[StepReport], plan: ResolvedPlan, flops_per_sample: int,
                 peak_tflops: float) -> dict[str, float]:
    """The metrics of one logged step from every rank's report: the slowest rank's step time, the
    throughput of the whole step, FLOP rate and MFU, eval metrics and measured memory."""
    lead = reports[0]
    step_times = [r.step_time_s for r in reports]
    slowest = max(step_times)
    if not math.isfinite(slowest):
        # An attempt resumed at the last step trained nothing: its report has a loss and an
        # evaluation, and no time to make rates of.
        return {"loss": lead.loss, "lr": lead.lr, "epoch": lead.epoch, **lead.evaluation}
    metrics = {
        "loss": lead.loss, "lr": lead.lr, "step_time_s": slowest,
        "samples_per_s": plan.global_batch_size / slowest,
        "step_time_spread_s": slowest - min(step_times), "epoch": lead.epoch,
    }
    if lead.tokens_per_s is not None:  # data with tokens: every rank of one replica reports its replica's tokens
        metrics["tokens_per_s"] = sum(r.tokens_per_s for r in reports) / plan.tp / plan.pp
    # Every device does an equal share of the step's FLOPs (dp splits the batch, tp the layers).
    tflops = flops_per_sample * plan.global_batch_size / slowest / plan.world_size / 1e12
    metrics["tflops_per_device"] = tflops
    if peak_tflops > 0:
        metrics["mfu"] = tflops / peak_tflops
    metrics.update(lead.evaluation)
    # The phases of the slowest rank, whose step is the step time: what it spent its time on.
    paced_by = max(reports, key=lambda r: r.step_time_s)
    metrics.update({f"{PHASE_METRIC}/{phase}_s": seconds for phase, seconds in paced_by.phase_time_s.items()})
    if lead.measured_peak_bytes is not None:
        # The most loaded rank is what has to fit; the planner predicts that rank.
        metrics["memory/measured_peak_bytes"] = max(r.measured_peak_bytes for r in reports)
        metrics["memory/measured_state_bytes"] = max(r.measured_state_bytes for r in reports)
        for r in reports:
            metrics[f"memory/rank{r.rank}/measured_peak_bytes"] = r.measured_peak_bytes
    return metrics


def mean_peak_tflops(worker_facts: list[WorkerFacts]) -> float:
    peaks = [f.peak_tflops for f in worker_facts]
    return sum(peaks) / len(peaks) if peaks else 0.0


class MeasurementsOnce:
    """Passes a step's metrics on, less the memory measurements already passed with the same value.

    Every report after the memory probe carries that one step's measurement (the final report
    and a trial's read it there), but it is a single measurement: logged once per attempt, it
    still is the run's latest value and the maximum of its history, and a run logging every step
    commits a third fewer rows to its tracking store (MLflow's SQL store spends about 0.1 ms of
    the driver's CPU per row).
    """

    def __init__(self) -> None:
        self._logged: dict[str, float] = {}

    def fresh(self, metrics: dict[str, float]) -> dict[str, float]:
        passed = {}
        for key, value in metrics.items():
            if key.startswith("memory/"):
                if self._logged.get(key) == value:
                    continue
                self._logged[key] = value
            passed[key] = value
        return passed
