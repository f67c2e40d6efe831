"""What `orch tune` found: the ranked search, the trials and the winner, as text for the terminal
and JSON for `--json` and the tuning run."""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from orch.plans.engines import engine_spec
from orch.plans.memory.build import format_bytes
from orch.plans.resolve import ResolvedPlan
from orch.plans.search.space import Candidate, SearchResult
from orch.plans.spec import Accelerator, ClusterSpec, OptimSpec, Precision, TrainSpec
from orch.plans.step_time.cost_model import Speeds, StepTime, declared_speed_values
from orch.plans.step_time.failures import FailureModel, failure_model
from orch.plans.step_time.ranges import StepRange, corrected_range, ratio_range
from orch.tune.plan_file import train_command


@dataclass(frozen=True, kw_only=True)
class TrainBudget:
    """The whole training a plan's predicted speed is priced against: its time, cost and MFU."""

    tokens: int
    source: str
    """Where ``tokens`` comes from: ``train.tokens``, or steps x global batch x sequence."""
    devices: int
    peak_tflops: float | None
    """Dense peak TFLOP/s of one device as declared (``cluster.device_tflops`` or the GPU default);
    None on CPU workers, whose declared number is an order of magnitude, not a peak."""
    device_hour_usd: float | None = None
    failures: FailureModel | None = None
    """The cluster's declared failures (``cluster.mtbf_hours``): each plan's expected time to train
    with them and its checkpoint interval (:mod:`orch.plans.step_time.failures`); None: not priced."""
    unit: str = "tokens"
    """What ``tokens`` and the rates count: tokens for a workload whose samples are sequences,
    samples for one whose are not (images, tabular rows), where a 'token' would be a sample."""

    @classmethod
    def declared(cls, train: TrainSpec, cluster: ClusterSpec, global_batch_size: int, seq_len: int | None,
                 precision: Precision | None = None, *, param_count: int | None = None,
                 optim: OptimSpec | None = None) -> TrainBudget:
        """``seq_len``: tokens per sample, or None for a workload without tokens; ``param_count`` and
        ``optim`` size the checkpoint failures are priced with."""
        unit = "tokens" if seq_len else "samples"
        seq_len = seq_len or 1
        if train.tokens:
            tokens, source = train.tokens, "train.tokens"
        else:
            tokens = train.steps * global_batch_size * seq_len
            source = (f"train.steps {train.steps} x global batch {global_batch_size}"
                      + (f" x sequence {seq_len}" if unit == "tokens" else ""))
        peak = (declared_speed_values(cluster, precision)["device_tflops"] if cluster.accelerator == Accelerator.gpu
                else None)
        failures = (failure_model(cluster, param_count, precision or Precision.fp32, optim)
                    if param_count is not None and optim is not None else None)
        return cls(tokens=tokens, source=source, devices=cluster.world_size, peak_tflops=peak,
                   device_hour_usd=cluster.device_hour_usd, failures=failures, unit=unit)

    def time_s(self, step: StepTime) -> float:
        """Predicted seconds to train ``tokens`` at the plan's predicted throughput."""
        return self.tokens / step.tokens_per_s

    def cost_usd(self, step: StepTime) -> float | None:
        """What those device-hours cost at ``cluster.device_hour_usd`` (None when it is not set)."""
        if self.device_hour_usd is None:
            return None
        return self.time_s(step) / 3600 * self.devices * self.device_hour_usd

    def mfu(self, step: StepTime) -> float | None:
        """Model FLOPs utilization: the model's FLOPs (recomputation not counted) per second and
        device over the device's declared peak."""
        return None if not self.peak_tflops else step.model_tflops_per_device / self.peak_tflops

    def expected_time_s(self, step: StepTime) -> float | None:
        """The time to train with the declared failures, checkpointing at the best interval (None
        when failures are not declared)."""
        return None if self.failures is None else self.time_s(step) * self.failures.factor()

    def as_json(self) -> dict:
        failures = None
        if self.failures is not None:
            failures = {**dataclasses.asdict(self.failures), "interval_s": self.failures.interval_s,
                        "factor": self.failures.factor()}
        return {"tokens": self.tokens, "source": self.source, "devices": self.devices,
                "peak_tflops": self.peak_tflops, "device_hour_usd": self.device_hour_usd, "unit": self.unit,
                "failures": failures}

    def predicted_json(self, step: StepTime) -> dict:
        doc = {"mfu": self.mfu(step), "time_to_train_s": self.time_s(step), "cost_usd": self.cost_usd(step)}
        if self.failures is not None:
            doc["expected_time_to_train_s"] = self.expected_time_s(step)
            doc["checkpoint_every"] = self.failures.checkpoint_every(step.total_s)
        return doc

    def range_json(self, step: StepTime, ratios: StepRange) -> dict:
        """P10 and P90 of the step time, the time to train and the cost (None unpriced): each is the
        prediction times the same ratios, as the time and the cost are the step time times a constant."""
        def quantiles(value: float | None) -> dict | None:
            if value is None:
                return None
            scaled = ratios.scaled(value)
            return {"p10": scaled.p10, "p90": scaled.p90}

        return {"step_time_s": quantiles(step.total_s), "time_to_train_s": quantiles(self.time_s(step)),
                "cost_usd": quantiles(self.cost_usd(step))}


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
    budget: TrainBudget | None = None
    """The token budget each plan's time to train, cost and MFU are predicted for."""
    trials: list[Trial] = field(default_factory=list)
    winner: Candidate | None = None
    winner_trial: Trial | None = None
    plan_file: Path | str | None = None
    """Where the winner's plan file was written: a path, or a URI (``tune.out=s3://...``)."""
    plan_text: str | None = None
    overrides: list[str] = field(default_factory=list)
    parent_run_id: str | None = None
    runs_range: StepRange | None = None
    """The ratio range of predictions a cluster profile's runs corrected
    (:func:`orch.plans.step_time.profile.runs_range`), when the speeds carry such corrections."""

    def ratio_range(self) -> StepRange | None:
        """Measured / predicted step time, P10 to P90, for predictions at these speeds on the
        cluster's accelerator (:func:`orch.plans.step_time.ranges.ratio_range`), or over the profile's
        recorded runs when they corrected the speeds; None when no plan fits."""
        if not self.search.ranked:
            return None
        if self.speeds.phase_scale:
            return self.runs_range or corrected_range()
        return ratio_range(self.speeds.source, self.search.ranked[0].plan.accelerator.value)

    def as_json(self, top_k: int) -> dict:
        tried = {id(t.candidate): t for t in self.trials}
        shown = self.search.ranked[:top_k] + [t.candidate for t in self.trials if t.candidate not in
                                              self.search.ranked[:top_k]]
        ratios = self.ratio_range()
        candidates = [candidate_json(c, tried.get(id(c)), self.budget, ratios) for c in shown]
        best = None
        if self.winner:
            best = {**candidate_json(self.winner, self.winner_trial, self.budget, ratios),
                    "chosen_by": "measured" if self.winner_trial else "predicted",
                    "plan_file": str(self.plan_file) if self.plan_file else None, "overrides": self.overrides,
                    "train_command": train_command(self)}
        return {"global_batch_size": self.global_batch_size, "enumerated": self.search.enumerated,
                "feasible": len(self.search.ranked), "search_s": self.search.seconds,
                "rejected": dict(self.search.rejected.most_common()),
                "speeds": {**dataclasses.asdict(self.speeds), "note": self.speeds_note},
                "budget": self.budget.as_json() if self.budget else None,
                "range_ratio": ratios.as_json() if ratios else None,
                "candidates": candidates, "best": best, "parent_run_id": self.parent_run_id}


def candidate_json(c: Candidate, trial: Trial | None, budget: TrainBudget | None = None,
                   ratios: StepRange | None = None) -> dict:
    """One plan: its predicted step, time to train and cost, their P10-P90 (``range``: None when the
    cost model's error is not known for these speeds) and its trial's measurements where it ran."""
    doc = {"plan": c.plan.as_dict(), "feasible": c.feasible,
           "predicted": {**c.predicted.as_dict(), "peak_bytes": c.estimate.per_device.total,
                         **(budget.predicted_json(c.predicted) if budget else {})}}
    if budget:
        doc["predicted"]["range"] = (budget.range_json(c.predicted, ratios) if ratios and ratios.known
                                     else None)
    if trial is not None:
        doc["measured"] = trial.measured()
    return doc


def describe(plan: ResolvedPlan) -> str:
    """The plan in one line, its engine first."""
    return f"{plan.engine} {_layout_text(plan)}"


def _layout_text(plan: ResolvedPlan) -> str:
    """The plan but its engine, compact: the engine's own settings and offload as its spec says them."""
    spec = engine_spec(plan.engine)
    pipeline = ""
    if plan.pp > 1 and (plan.pp_schedule.value != "1f1b" or plan.pp_virtual_stages > 1):
        pipeline = plan.pp_schedule.value + (f"/v{plan.pp_virtual_stages}" if plan.pp_virtual_stages > 1 else "") + " "
    context = f"cp={plan.cp} " if plan.cp > 1 else ""
    return (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} {context}{pipeline}{spec.short_settings(plan)} "
            f"offload={spec.short_offload(plan)} "
            f"ckpt={_recompute_text(plan)} micro={plan.micro_batch_size} "
            f"accum={plan.grad_accum_steps}" + (" compiled" if plan.compile else "")
            + (" seq-parallel" if plan.sequence_parallel else "") + (" async-tp" if plan.async_tp else "")
            + (f" fp8/{plan.fp8_recipe.value}" if plan.precision == Precision.fp8 else ""))


def _recompute_text(plan: ResolvedPlan) -> str:
    """Recomputation, short: off, selective, on (full); ``/n`` when every n-th block only."""
    text = {"none": "off", "full": "on"}.get(plan.activation_checkpointing.value, plan.activation_checkpointing.value)
    every = plan.recompute_every_n_layers if plan.activation_checkpointing else 1
    return f"{text}/{every}" if every > 1 else text


def _mem(n: int | None) -> str:
    if n is None:
        return "-"
    return format_bytes(n)


def _time_unit(seconds: float) -> tuple[str, int]:
    """The unit a time to train reads best in, and its seconds."""
    for unit, size, limit in (("s", 1, 120), ("min", 60, 120 * 60), ("h", 3600, 72 * 3600)):
        if seconds < limit:
            return unit, size
    return "d", 86400


def _in_unit(seconds: float, size: int) -> str:
    return f"{seconds / size:,.1f}" if size == 86400 else f"{seconds / size:.3g}"


def duration(seconds: float) -> str:
    """A time to train in the unit it reads best in."""
    unit, size = _time_unit(seconds)
    return f"{_in_unit(seconds, size)} {unit}"


def duration_range(low: float, high: float) -> str:
    """Two times to train, the unit said once where both read best in the same one: ``75-80.6 s``."""
    unit, size = _time_unit(low)
    if _time_unit(high)[0] != unit:
        return f"{duration(low)}-{duration(high)}"
    return f"{_in_unit(low, size)}-{_in_unit(high, size)} {unit}"


def _usd(amount: float) -> str:
    return f"${amount:,.0f}" if amount >= 100 else f"${amount:,.2f}"


def _usd_range(low: float, high: float) -> str:
    return f"{_usd(low)}-{_usd(high)}"


def _budget_columns(budget: TrainBudget | None, step: StepTime | None) -> str:
    """MFU, time to train and (with a price) cost, for the table; the header when ``step`` is None."""
    if budget is None:
        return ""
    priced = budget.device_hour_usd is not None
    if step is None:
        return f" {'MFU':>6} {'to train':>10}" + (f" {'cost':>12}" if priced else "")
    mfu = budget.mfu(step)
    text = f" {f'{mfu:.1%}' if mfu is not None else '-':>6} {duration(budget.time_s(step)):>10}"
    return text + (f" {_usd(budget.cost_usd(step)):>12}" if priced else "")


def _between(ratios: StepRange, value: float, fmt) -> str:
    """`` (P10-P90 a-b)`` around a predicted value, ``fmt`` formatting the pair; nothing without a range."""
    if not ratios.known:
        return ""
    scaled = ratios.scaled(value)
    return f" (P10-P90 {fmt(scaled.p10, scaled.p90)})"


def render(result: TuneResult, top_k: int) -> str:
    s = result.search
    budget = result.budget
    unit = budget.unit if budget else "tokens"
    lines = [f"searched {s.enumerated} plans in {s.seconds:.2f}s: {len(s.ranked)} fit, "
             f"{s.enumerated - len(s.ranked)} rejected; global batch {result.global_batch_size}",
             f"speeds: {result.speeds_note}"]
    if budget:
        lines.append(f"time to train {budget.tokens:,} {unit} ({budget.source}) on {budget.devices} devices"
                     + (f" at ${budget.device_hour_usd:g} per device-hour" if budget.device_hour_usd is not None
                        else "; set cluster.device_hour_usd to price it")
                     + ("; MFU: the model's FLOPs (no recomputation) over the declared peak "
                        f"{budget.peak_tflops:g} TFLOP/s" if budget.peak_tflops else ""))
        if budget.failures is not None:
            lines.append(f"failures: {budget.failures.describe()}")
    lines += ["", f"{'#':>3}  {'engine':<9} {'plan':<66} {'step s':>9} {unit + '/s':>11} {'TFLOP/s':>8}"
              f"{_budget_columns(budget, None)} {'peak mem':>10}  measured"]
    tried = {id(t.candidate): t for t in result.trials}
    shown = s.ranked[:top_k] + [t.candidate for t in result.trials if t.candidate not in s.ranked[:top_k]]
    for c in shown:
        rank = s.ranked.index(c) + 1
        p = c.predicted
        trial = tried.get(id(c))
        measured = ""
        if trial and trial.status == "ok":
            measured = f"{trial.step_time_s:.3g} s, {trial.tokens_per_s:,.0f} {unit}/s, {_mem(trial.peak_bytes)}"
        elif trial:
            measured = f"{trial.status}: {trial.error}"
        lines.append(f"{rank:>3}  {c.plan.engine:<9} {_layout_text(c.plan):<66} "
                     f"{p.total_s:>9.3g} {p.tokens_per_s:>11,.0f} "
                     f"{p.tflops_per_device:>8.3g}{_budget_columns(budget, p)} {_mem(c.estimate.per_device.total):>10}"
                     f"  {measured}")
    if len(s.ranked) > len(shown):
        lines.append(f"     ... {len(s.ranked) - len(shown)} more that fit (tune.top_k={top_k})")
    lines += ["", "rejected, by reason:"]
    lines += [f"  {count:>7}  {reason}" for reason, count in s.rejected.most_common()] or ["  none"]
    if result.winner:
        chosen = "best measured" if result.winner_trial else "best predicted"
        lines += ["", f"winner ({chosen}): {describe(result.winner.plan)}"]
        if budget:
            step = result.winner.predicted
            cost = budget.cost_usd(step)
            ratios = result.ratio_range()
            time_s = budget.time_s(step)
            lines.append(f"  predicted to train {budget.tokens:,} {unit} in {duration(time_s)}"
                         + _between(ratios, time_s, duration_range)
                         + (f" for {_usd(cost)}{_between(ratios, cost, _usd_range)}" if cost is not None else ""))
            lines.append(f"  {'range: ' if ratios.known else ''}{ratios.source}")
            if budget.failures is not None:
                expected = budget.expected_time_s(step)
                lines.append(f"  with failures: {duration(expected)}" + _between(ratios, expected, duration_range)
                             + f", checkpointing every {budget.failures.checkpoint_every(step.total_s)} steps "
                             f"(train.checkpoint_every={budget.failures.checkpoint_every(step.total_s)})")
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
