"""What `orch tune` found: the ranked search, the trials and the winner, as text for the terminal
and JSON for `--json` and the tuning run."""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.plan_file import train_command
from plans.cost_model import Speeds
from plans.estimate import GIB
from plans.resolve import ResolvedPlan
from plans.search_space import Candidate, SearchResult
from plans.spec import Offload


@dataclass(kw_only=True)
class Trial:
    """One short real run of a candidate."""

    index: int
    candidate: Candidate
    status: str = "pending"
    """ok, failed or timeout."""
    error: str | None = None
    run_id: str | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None
    peak_bytes: int | None = None
    wall_s: float = 0.0

    def measured(self) -> dict:
        if self.status != "ok":
            return {"status": self.status, "error": self.error, "run_id": self.run_id}
        return {"status": "ok", "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "peak_bytes": self.peak_bytes, "run_id": self.run_id}


@dataclass(kw_only=True)
class TuneResult:
    search: SearchResult
    speeds: Speeds
    speeds_note: str
    global_batch_size: int
    trials: list[Trial] = field(default_factory=list)
    winner: Candidate | None = None
    winner_trial: Trial | None = None
    plan_file: Path | str | None = None
    """Where the winner's plan file was written: a path, or a URI (``tune.out=s3://...``)."""
    plan_text: str | None = None
    overrides: list[str] = field(default_factory=list)
    parent_run_id: str | None = None

    def as_json(self, top_k: int) -> dict:
        tried = {id(t.candidate): t for t in self.trials}
        shown = self.search.ranked[:top_k] + [t.candidate for t in self.trials if t.candidate not in
                                              self.search.ranked[:top_k]]
        candidates = [candidate_json(c, tried.get(id(c))) for c in shown]
        best = None
        if self.winner:
            best = {**candidate_json(self.winner, self.winner_trial),
                    "chosen_by": "measured" if self.winner_trial else "predicted",
                    "plan_file": str(self.plan_file) if self.plan_file else None, "overrides": self.overrides,
                    "train_command": train_command(self)}
        return {"global_batch_size": self.global_batch_size, "enumerated": self.search.enumerated,
                "feasible": len(self.search.ranked), "search_s": self.search.seconds,
                "rejected": dict(self.search.rejected.most_common()),
                "speeds": {**dataclasses.asdict(self.speeds), "note": self.speeds_note},
                "candidates": candidates, "best": best, "parent_run_id": self.parent_run_id}


def candidate_json(c: Candidate, trial: Trial | None) -> dict:
    doc = {"plan": c.plan.as_dict(), "feasible": c.feasible,
           "predicted": {**c.predicted.as_dict(), "peak_bytes": c.estimate.per_device.total}}
    if trial is not None:
        doc["measured"] = trial.measured()
    return doc


def describe(plan: ResolvedPlan) -> str:
    off = plan.offload_optimizer.value + ("+param" if plan.offload_param != Offload.none else "")
    return (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero_stage} offload={off} "
            f"ckpt={'on' if plan.activation_checkpointing else 'off'} micro={plan.micro_batch_size} "
            f"accum={plan.grad_accum_steps}")


def _mem(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 1024**2:.1f} MiB"


def render(result: TuneResult, top_k: int) -> str:
    s = result.search
    lines = [f"searched {s.enumerated} plans in {s.seconds:.2f}s: {len(s.ranked)} fit, "
             f"{s.enumerated - len(s.ranked)} rejected; global batch {result.global_batch_size}",
             f"speeds: {result.speeds_note}", "",
             f"{'#':>3}  {'plan':<66} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'peak mem':>10}  measured"]
    tried = {id(t.candidate): t for t in result.trials}
    shown = s.ranked[:top_k] + [t.candidate for t in result.trials if t.candidate not in s.ranked[:top_k]]
    for c in shown:
        rank = s.ranked.index(c) + 1
        p = c.predicted
        trial = tried.get(id(c))
        measured = ""
        if trial and trial.status == "ok":
            measured = f"{trial.step_time_s:.3g} s, {trial.tokens_per_s:,.0f} tok/s, {_mem(trial.peak_bytes)}"
        elif trial:
            measured = f"{trial.status}: {trial.error}"
        lines.append(f"{rank:>3}  {describe(c.plan):<66} {p.total_s:>9.3g} {p.tokens_per_s:>11,.0f} "
                     f"{p.tflops_per_device:>8.3g} {_mem(c.estimate.per_device.total):>10}  {measured}")
    if len(s.ranked) > len(shown):
        lines.append(f"     ... {len(s.ranked) - len(shown)} more that fit (tune.top_k={top_k})")
    lines += ["", "rejected, by reason:"]
    lines += [f"  {count:>7}  {reason}" for reason, count in s.rejected.most_common()] or ["  none"]
    if result.winner:
        chosen = "best measured" if result.winner_trial else "best predicted"
        lines += ["", f"winner ({chosen}): {describe(result.winner.plan)}"]
        if result.plan_file:
            lines.append(f"  written to {result.plan_file}")
            command = train_command(result)
            if command:
                lines.append(f"  train it: {command}")
        lines.append(f"  or: orch train {' '.join(result.overrides)}")
    if result.parent_run_id:
        lines.append(f"MLflow: tuning run {result.parent_run_id} with {len(result.trials)} nested trial run(s)")
    return "\n".join(lines)


def to_json_text(result: TuneResult, top_k: int) -> str:
    buffer = io.StringIO()
    json.dump(result.as_json(top_k), buffer, indent=2, default=str)
    return buffer.getvalue()
