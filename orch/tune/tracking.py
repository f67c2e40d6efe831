"""The tuning run in MLflow: its parameters, each trial's predicted and measured step time, the
ranking, the winner's plan file and a predicted-against-measured chart."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from orch.config import RunConfig
from orch.tune.result import TuneResult, describe, render


def start_parent(cfg: RunConfig, model_cfg: dict, cluster, result: TuneResult):
    from orch.tracking.store import RunTracker, flatten, git_commit
    from orch.tracking.train_run import address_param, reachable_tracking

    cfg = reachable_tracking(cfg)
    params = flatten({"tune": dataclasses.asdict(cfg.tune), "model": dict(model_cfg),
                      "cluster": {**dataclasses.asdict(cluster), "address": address_param(cluster.address)}})
    params.update({"tune.global_batch_size": str(result.global_batch_size),
                   "tune.enumerated": str(result.search.enumerated), "tune.feasible": str(len(result.search.ranked)),
                   "tune.speeds_source": result.speeds.source})
    tags = {"orch.command": "tune"}
    if commit := git_commit():
        tags["git_commit"] = commit
    return RunTracker.start(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                            run_name=cfg.tracking.run_name or "tune", params=params, tags=tags)


def finish_parent(tracker, result: TuneResult, cfg: RunConfig, status: str) -> None:
    doc = result.as_json(cfg.tune.top_k)
    tracker.log_dict(doc, "tune/candidates.json")
    tracker.log_text(render(result, cfg.tune.top_k), "tune/ranked.txt")
    if result.plan_text:
        tracker.log_text(result.plan_text, "tune/winner.yaml")
    for trial in result.trials:
        tracker.set_tags({f"trial.{trial.index}.status": trial.status,
                          f"trial.{trial.index}.plan": describe(trial.candidate.plan),
                          **({f"trial.{trial.index}.error": trial.error[:500]} if trial.error else {})})
        metrics = {"predicted_step_time_s": trial.candidate.predicted.total_s}
        if trial.status == "ok":
            metrics.update({"measured_step_time_s": trial.step_time_s, "measured_tokens_per_s": trial.tokens_per_s})
        tracker.log_metrics(metrics, step=trial.index)
    if result.winner:
        tracker.set_tags({"tune.winner": describe(result.winner.plan),
                          "tune.winner_chosen_by": "measured" if result.winner_trial else "predicted"})
    _log_chart(tracker, result)
    tracker.finish(status)


def _log_chart(tracker, result: TuneResult) -> None:
    """Predicted against measured step time of every trial (failed ones marked), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        ok = [t for t in result.trials if t.status == "ok"]
        bad = [t for t in result.trials if t.status != "ok"]
        if ok:
            xs = [t.candidate.predicted.total_s for t in ok]
            ys = [t.step_time_s for t in ok]
            ax.scatter(xs, ys, label="trials")
            for t, x, y in zip(ok, xs, ys, strict=True):
                ax.annotate(str(t.index), (x, y), textcoords="offset points", xytext=(4, 4))
            lo, hi = min(xs + ys), max(xs + ys)
            ax.plot([lo, hi], [lo, hi], linestyle="--", color="grey", label="measured = predicted")
        if bad:
            ax.scatter([t.candidate.predicted.total_s for t in bad], [0] * len(bad), marker="x", color="red",
                       label="failed / timed out")
        ax.set_xlabel("predicted step time (s)")
        ax.set_ylabel("measured step time (s)")
        ax.set_title("orch tune: candidates, predicted vs measured")
        if ok or bad:
            ax.legend()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tune_candidates.png"
            fig.savefig(path, dpi=100, bbox_inches="tight")
            tracker.client.log_artifact(tracker.run_id, str(path), "plots")
        plt.close(fig)
    except Exception as exc:  # a picture is a convenience; the numbers are already logged
        print(f"warning: could not log the tuning chart ({type(exc).__name__}: {exc})", file=sys.stderr)
