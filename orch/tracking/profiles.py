"""The steps run under the profiler (``train.profile_steps``), into the run and onto the screen.

No MLflow here: a run without tracking still prints what its profiled steps spent their time on.
"""

from __future__ import annotations

PROFILE_METRIC = "profile"
"""Prefix of the profiled steps' metrics: ``profile/<kind>_s`` (the slowest rank's) and
``profile/rank<r>/<kind>_s``."""


def profile_metric_name(kind: str) -> str:
    """The metric word of a kind of work (:data:`orch.launchers.step_profile.KINDS`)."""
    return {"element-wise and other": "elementwise"}.get(kind, kind)


def record_profiles(tracker, reports: list, out) -> None:
    """The profiled steps of one logged step's reports (``train.profile_steps``): each rank's trace
    as ``profile/step<N>/rank<r>.trace.json.gz``, their time by kind of work as metrics, and the
    slowest rank's summary printed."""
    from orch.launchers.step_profile import KINDS, summary

    by_step: dict[int, list] = {}
    for report in reports:
        for profile in report.profiles:
            by_step.setdefault(profile.step, []).append((report.rank, profile))
    for step, ranked in sorted(by_step.items()):
        rank, slowest = max(ranked, key=lambda item: item[1].wall_s)
        print(f"profile: {summary(slowest)} (rank {rank}, the slowest of {len(ranked)})", file=out, flush=True)
        if tracker is None:
            continue
        tracker.set_tags({f"{PROFILE_METRIC}.clock": slowest.clock})
        # Every kind, 0 where none ran: a run's latest values are then all the last profiled step's.
        metrics = {f"{PROFILE_METRIC}/{profile_metric_name(kind)}_s": slowest.seconds.get(kind, 0.0) for kind in KINDS}
        metrics[f"{PROFILE_METRIC}/wall_s"] = slowest.wall_s
        for r, profile in ranked:
            metrics.update({f"{PROFILE_METRIC}/rank{r}/{profile_metric_name(kind)}_s": profile.seconds.get(kind, 0.0)
                            for kind in KINDS})
            tracker.log_bytes(profile.trace_gz, f"{PROFILE_METRIC}/step{step}/rank{r}.trace.json.gz")
        tracker.log_metrics(metrics, step)
        print(f"profile: traces of step {step} in the MLflow run under {PROFILE_METRIC}/step{step}/ (open them in "
              "Perfetto or chrome://tracing)", file=out, flush=True)
