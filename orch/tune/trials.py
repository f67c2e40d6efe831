"""`orch tune`'s trials: each candidate as a short real run (a full ``run_training`` with its own
worker group, nested under the tuning run in MLflow), any failure contained and recorded."""

from __future__ import annotations

import dataclasses
import statistics
import time

from omegaconf import OmegaConf

from orch.config import RunConfig
from orch.plans.errors import OrchError
from orch.plans.model.workload import Workload
from orch.plans.resolve import ResolvedPlan
from orch.plans.search.space import Candidate, SearchContext, plan_spec
from orch.plans.spec import ResumeMode, TrainSpec
from orch.tune.plan_file import plan_values
from orch.tune.result import Trial, TuneResult, describe


class TrialTimeout(OrchError):
    """A trial ran past tune.trial_timeout_s."""


def pick_winner(result: TuneResult) -> None:
    measured = [t for t in result.trials if t.status == "ok"]
    if measured:
        best = max(measured, key=lambda t: t.tokens_per_s)
        result.winner, result.winner_trial = best.candidate, best
    else:
        result.winner = result.search.ranked[0]


def measuring_run(train: TrainSpec, steps: int, **changes) -> TrainSpec:
    """The loop of a short run made to be measured (a tuner's trial, a calibration's reference run):
    every step reported and timed, memory probed at step 2, one evaluation batch, nothing saved,
    resumed or restarted; ``changes`` on top."""
    measuring = {"steps": steps, "log_every": 1, "eval_every": 0, "eval_batches": 1, "memory_probe_step": 2,
                 "profile_steps": [], "checkpoint_every": 0, "resume": ResumeMode.never, "max_failures": 0}
    return dataclasses.replace(train, **{**measuring, **changes})


def trial_config(cfg: RunConfig, plan: ResolvedPlan, index: int, parent_name: str) -> RunConfig:
    steps = max(cfg.tune.trial_steps, 3)

    def within_trial(limit_s: float) -> float:
        """A train limit capped at the trial's (0, no limit, becomes the trial's)."""
        return min(limit_s or cfg.tune.trial_timeout_s, cfg.tune.trial_timeout_s)

    train = measuring_run(cfg.train, steps, global_batch_size=plan.global_batch_size,
                          hang_timeout_s=within_trial(cfg.train.hang_timeout_s),
                          setup_timeout_s=within_trial(cfg.train.setup_timeout_s))
    tracking = dataclasses.replace(cfg.tracking, run_name=f"{parent_name}-trial{index}")
    return dataclasses.replace(cfg, plan=plan_spec(plan), train=train, tracking=tracking)


def run_trial(cfg: RunConfig, model_cfg: dict, candidate: Candidate, index: int, ctx: SearchContext,
              result: TuneResult, err, workload: Workload | None = None) -> Trial:
    """One candidate as a short real run; any failure is caught, reported and recorded.
    ``workload`` is the tuner's, reused unless the trial's model takes the plan's tp."""
    from orch.run.driver import run_training

    plan = candidate.plan
    trial = Trial(index=index, candidate=candidate)
    total = min(cfg.tune.trials, len(result.search.ranked)) if cfg.tune.trials else len(result.search.ranked)
    print(f"tune: trial {index}/{total}: {describe(plan)} (predicted {candidate.predicted.total_s:.3g} s/step)",
          file=err, flush=True)
    trial_cfg = trial_config(cfg, plan, index, cfg.tracking.run_name or "tune")
    trial_model = {**model_cfg, "tp": plan.tp} if "tp" in model_cfg else model_cfg
    yaml = OmegaConf.to_yaml(OmegaConf.create({"model": trial_model, "plan": plan_values(plan),
                                               "train": dataclasses.asdict(trial_cfg.train)}))
    started = time.perf_counter()

    def deadline(_reports, _facts) -> None:
        if time.perf_counter() - started > cfg.tune.trial_timeout_s:
            raise TrialTimeout(f"trial {index} ran past tune.trial_timeout_s={cfg.tune.trial_timeout_s:g}")

    tags = {"orch.tune.trial": str(index)}
    if result.parent_run_id:
        tags["mlflow.parentRunId"] = result.parent_run_id
    try:
        run = run_training(trial_cfg, trial_model, yaml, stream=err, on_report=deadline, tags=tags,
                           workload=workload if trial_model is model_cfg else None)
    except Exception as exc:  # contained: one bad plan (OOM, crash, hang) must not end the tuning
        trial.status = "timeout" if isinstance(exc, TrialTimeout) else "failed"
        first = str(exc).strip().splitlines()
        trial.error = f"{type(exc).__name__}: {first[0][:300] if first else ''}"
        trial.run_id = _trial_run_id(cfg, result.parent_run_id, index)
        trial.wall_s = time.perf_counter() - started
        print(f"tune: trial {index} {trial.status}: {trial.error}; tuning goes on", file=err, flush=True)
        return trial
    trial.wall_s = time.perf_counter() - started
    trial.run_id = run.run_id
    timed = [reports for reports in run.reports if reports[0].step not in (1, trial_cfg.train.memory_probe_step)]
    step_time = statistics.median(max(r.step_time_s for r in reports) for reports in (timed or run.reports))
    flops = ctx.model_cost.flops_per_sample_of(plan)
    trial.status = "ok"
    trial.step_time_s = step_time
    trial.tokens_per_s = plan.global_batch_size * ctx.model_cost.seq_len / step_time
    trial.tflops_per_device = flops * plan.global_batch_size / step_time / plan.world_size / 1e12
    peaks = [r.measured_peak_bytes for reports in run.reports for r in reports if r.measured_peak_bytes is not None]
    trial.peak_bytes = max(peaks) if peaks else None
    print(f"tune: trial {index}: measured {trial.step_time_s:.3g} s/step, {trial.tokens_per_s:,.0f} tokens/s "
          f"(predicted {candidate.predicted.total_s:.3g} s/step)", file=err, flush=True)
    return trial


def _trial_run_id(cfg: RunConfig, parent_id: str | None, index: int) -> str | None:
    """The MLflow run a failed trial left behind (run_training raised before returning it)."""
    if not parent_id:
        return None
    from orch.tracking.store import open_client

    client = open_client(cfg.tracking.uri)
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}' and "
                                            f"tags.`orch.tune.trial` = '{index}'")
    return runs[0].info.run_id if runs else None
