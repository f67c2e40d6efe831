"""`orch train --multirun`: one parent MLflow run per sweep, each job a nested child run.

Hydra runs a sweep's jobs and calls its callbacks around them (``hydra.callbacks`` in
orch/conf/config.yaml names :class:`SweepTracking`). When the sweep starts, the callback opens the
parent run and puts its id in :data:`PARENT_ENV`, which the jobs read to tag their runs with
``mlflow.parentRunId``, as `orch tune` does for its trials (a launcher that runs jobs in other
processes passes the environment on). When the sweep ends, the parent gets the comparison: every
job's loss curve on one plot, and a table of each job's overrides, status and final metrics.

Each job returns its ``train.sweep_metric`` to Hydra, which is what optimizing sweepers (Optuna)
minimize. A job that fails raises, so the sweeper records a failed trial; Hydra's basic sweeper
runs the rest of its batch before it reports the failure.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orch.exits import Reported

PARENT_ENV = "ORCH_SWEEP_PARENT_RUN_ID"
"""The parent run of the sweep the current job belongs to."""
FINAL_METRICS = ("loss", "eval_loss", "eval_accuracy", "samples_per_s", "tokens_per_s")
"""The final metrics the comparison table shows, when the jobs logged them."""

command: str | None = None
"""The `orch` command running (set by orch.cli): only `orch train` sweeps are tracked."""


# What every run reports at its logged steps (orch.launchers.job.StepReport.named_values); evaluation
# adds eval_loss and eval_<name> for the objective's own metrics.
STEP_METRICS = ("loss", "local_loss", "lr", "step_time_s", "samples_per_s", "epoch", "tokens_per_s")


def sweep_metric_problem(metric: str, eval_batches: int):
    """Why ``train.sweep_metric`` cannot be what a sweep's jobs return, found before any of them
    trains (None if nothing is wrong): a name no run logs, or an evaluation metric of runs that
    evaluate on no batch."""
    from orch.plans.errors import Violation

    if metric.startswith("eval_"):
        if eval_batches > 0:
            return None
        return Violation("train.sweep_metric", metric, "is an evaluation metric, and train.eval_batches=0 "
                         "evaluates on no batch.", "set train.eval_batches > 0, or sweep on loss")
    if metric in STEP_METRICS:
        return None
    return Violation("train.sweep_metric", metric, f"is no metric a run logs: {', '.join(STEP_METRICS)}, "
                     "eval_loss or eval_<name> (the objective's own evaluation metrics).", "name one of those")


def child_tags() -> dict[str, str]:
    """Tags that nest the current job's run under its sweep's parent run (none outside a sweep)."""
    parent = os.environ.get(PARENT_ENV)
    return {"mlflow.parentRunId": parent, "orch.sweep": parent} if parent else {}


@dataclass
class _Job:
    number: int
    overrides: list[str]
    status: str
    run_id: str | None = None
    value: float | None = None
    error: str | None = None


@dataclass
class _Sweep:
    tracker: Any
    metric: str
    jobs: list[_Job] = field(default_factory=list)


class SweepTracking(Callback):
    """Hydra callback: the sweep's parent MLflow run, opened at its start and filled at its end."""

    def __init__(self) -> None:
        self._sweep: _Sweep | None = None
        self._last_run: dict[str, Any] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if command != "train" or not config.tracking.enabled:
            return
        from orch.tracking.store import RunTracker, git_commit

        sweep_dir = str(config.hydra.sweep.dir)
        params = {"sweep.dir": sweep_dir, "sweep.sweeper": str(config.hydra.sweeper.get("_target_", "")),
                  "sweep.metric": str(config.train.sweep_metric),
                  "sweep.overrides": " ".join(config.hydra.overrides.task)[:6000]}
        tags = {"orch.command": "sweep"}
        if commit := git_commit():
            tags["git_commit"] = commit
        tracker = RunTracker.start(uri=config.tracking.uri, experiment=config.tracking.experiment,
                                   run_name=f"sweep {Path(sweep_dir).name}", params=params, tags=tags)
        os.environ[PARENT_ENV] = tracker.run_id
        self._sweep = _Sweep(tracker=tracker, metric=str(config.train.sweep_metric))
        print(f"sweep tracked as MLflow run {tracker.run_id}; each job is nested under it")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self._sweep is None:
            return
        status = job_return.status.name
        job = _Job(number=int(config.hydra.job.num), overrides=list(config.hydra.overrides.task), status=status,
                   run_id=job_runs.pop(int(config.hydra.job.num), None))
        # JobReturn.return_value logs "Error executing job" each time it is read for a failed job,
        # and Hydra reads it again after the sweep: the failure is taken from its field instead.
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            error = error.error if isinstance(error, Reported) else error
            job.error = f"{type(error).__name__}: {error}"
        else:
            job.value = job_return.return_value
        self._sweep.jobs.append(job)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep, self._sweep = self._sweep, None
        os.environ.pop(PARENT_ENV, None)
        if sweep is None:
            return
        tracker = sweep.tracker
        try:
            compare(tracker, sweep)
        finally:
            done = [j for j in sweep.jobs if j.status == "COMPLETED"]
            tracker.finish("FINISHED" if done or not sweep.jobs else "FAILED")


job_runs: dict[int, str] = {}
"""The MLflow run of each job of the running sweep, by job number (the jobs record them)."""


def record_job_run(job_number: int, run_id: str | None) -> None:
    """Remember the current sweep job's run, for the parent's comparison."""
    if run_id and os.environ.get(PARENT_ENV):
        job_runs[job_number] = run_id


def compare(tracker: Any, sweep: _Sweep) -> None:
    """The sweep's comparison on its parent run: overlaid loss curves, the jobs' table, the best job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    client = tracker.client
    # Each job is named by what sets it apart: the overrides the jobs do not all share.
    common = set.intersection(*(set(j.overrides) for j in sweep.jobs)) if len(sweep.jobs) > 1 else set()
    rows = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for job in sorted(sweep.jobs, key=lambda j: j.number):
        metrics = client.get_run(job.run_id).data.metrics if job.run_id else {}
        varying = [o for o in job.overrides if o not in common]
        rows.append({"job": job.number, "overrides": varying, "status": job.status, "run_id": job.run_id,
                     sweep.metric: job.value, **{k: metrics[k] for k in FINAL_METRICS if k in metrics},
                     **({"error": job.error} if job.error else {})})
        if job.run_id:
            points = sorted(client.get_metric_history(job.run_id, "loss"), key=lambda m: m.step)
            if points:
                ax.plot([m.step for m in points], [m.value for m in points],
                        label=f"#{job.number} {' '.join(varying)}"[:60])
    ax.set(xlabel="step", ylabel="training loss", title=f"sweep: {len(sweep.jobs)} jobs")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    tracker.log_figure(fig, "sweep/loss_curves.png")
    plt.close(fig)
    tracker.log_dict({"metric": sweep.metric, "jobs": rows}, "sweep/jobs.json")
    tracker.log_text(jobs_table(rows, sweep.metric), "sweep/jobs.md")
    scored = [r for r in rows if isinstance(r[sweep.metric], float) and not math.isnan(r[sweep.metric])]
    tags = {"sweep.jobs": str(len(rows)), "sweep.failed": str(sum(r["status"] != "COMPLETED" for r in rows))}
    if scored:
        best = min(scored, key=lambda r: r[sweep.metric])
        tags.update({"sweep.best_job": str(best["job"]), "sweep.best_run_id": str(best["run_id"]),
                     "sweep.best_overrides": " ".join(best["overrides"])})
        tracker.log_metrics({f"best_{sweep.metric}": best[sweep.metric]}, step=0)
    tracker.set_tags(tags)


def jobs_table(rows: list[dict], metric: str) -> str:
    """The comparison as a Markdown table: one row per job."""
    columns = ["job", "overrides", "status", metric, *[k for k in FINAL_METRICS if k != metric
                                                       and any(k in r for r in rows)]]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            if isinstance(value, float):
                cells.append(f"{value:.4g}")
            elif isinstance(value, list):
                cells.append(" ".join(value) or "(none)")
            else:
                cells.append("-" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
