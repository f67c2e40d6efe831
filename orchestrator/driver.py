"""`orch train`: validate the plan, launch the worker group, show progress, track the run.

Order matters: every check that can fail on user input runs before any Ray resource exists,
and the MLflow run is ended (FINISHED, FAILED or KILLED) whatever happens after it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ray.exceptions import RayActorError

from launchers.checkpoint import Published, resumable
from launchers.ds_config import build_ds_config
from launchers.job import TrainJob, WorkerFacts
from launchers.passthrough import passthrough_env
from launchers.placement import placement_strategy, rank_layout
from launchers.ray_session import ray_session
from launchers.universal import convert as convert_to_universal
from launchers.universal import needs_universal
from launchers.worker_group import (
    WorkerDiedError,
    WorkerFailedError,
    WorkerGroup,
    WorkerGroupSpec,
    WorkerHangError,
    collective_timeout_env,
)
from orchestrator.checking import checked_run, live_cluster
from orchestrator.config import RunConfig
from orchestrator.credentials import redact_text
from orchestrator.inputs import data_fits_plan
from orchestrator.progress import Progress
from orchestrator.resume import checkpoint_dir_lock, signature_of
from orchestrator.startup import StartupClock
from orchestrator.startup import describe as describe_startup
from orchestrator.tracking import RunTracker, TrackingUnreachable, check_reachable, flatten, git_commit, redact_uri
from plans.errors import PlanError, Violation
from plans.estimate import PlanEstimate
from plans.flops import training_flops_per_sample
from plans.model_facts import ModelFacts
from plans.resolve import ResolvedPlan
from plans.spec import Accelerator, ClusterSpec, ResumeMode
from plans.workload import StreamingSource, data_task_cpus


@dataclass
class TrainResult:
    """What a finished run reports back (the CLI prints it; tests assert on it)."""

    run_id: str | None
    plan: ResolvedPlan
    model: ModelFacts
    estimate: PlanEstimate
    reports: list[list[dict]] = field(default_factory=list)
    """Per logged step, the report of every rank."""
    worker_facts: list[WorkerFacts] = field(default_factory=list)
    wall_s: float = 0.0
    startup: dict[str, float] = field(default_factory=dict)
    """Seconds of each start-up phase (orchestrator/startup.py), in the order they ran."""

    @property
    def time_to_first_report_s(self) -> float:
        """Launch to the first report: the start-up phases add up to it (0 if none arrived)."""
        return sum(self.startup.values())

    @property
    def final_loss(self) -> float:
        return self.reports[-1][0]["loss"]

    @property
    def eval_loss(self) -> float | None:
        return self.reports[-1][0].get("eval_loss")


def worker_env(plan: ResolvedPlan) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", **passthrough_env(os.environ)}
    if plan.accelerator == Accelerator.cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run_training(cfg: RunConfig, model_cfg: dict, config_yaml: str, *, stream=None,
                 on_report: Callable[[list[dict], list[dict]], None] | None = None,
                 tags: dict[str, str] | None = None) -> TrainResult:
    """Train one declared run end to end and return its result.

    ``on_report(reports, worker_facts)`` is called for every logged step, replays included
    (tests use it to inject faults at a known step). ``tags`` go onto the new MLflow run
    (`orch tune` nests its trials under its own run with ``mlflow.parentRunId``).
    """
    clock = StartupClock()
    with contextlib.ExitStack() as held, live_cluster(cfg, connect=True) as (cluster, notes):
        return _run_on(cluster, notes, clock, cfg, model_cfg, config_yaml, stream=stream, on_report=on_report,
                       tags=tags, held=held)


def _run_on(cluster: ClusterSpec, notes: list[str], clock: StartupClock, cfg: RunConfig, model_cfg: dict,
            config_yaml: str, *, stream, on_report, tags, held: contextlib.ExitStack) -> TrainResult:
    """:func:`run_training` on the cluster :func:`live_cluster` found (its connection still open).

    ``held`` keeps what the run holds until it ends: the checkpoint directory's lock, taken once
    the plan and inputs are known to be valid, so every problem with them is reported together.
    """
    out = stream or sys.stdout
    started = clock.started
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    estimate, facts, _, workload = checked_run(cfg, model_cfg, cluster)
    plan = estimate.plan
    data_fits_plan(workload.data, plan)
    if not estimate.feasible:
        if not cfg.train.force:
            raise PlanError(_with_suggestions(estimate))
        print("warning: the planner predicts this plan does not fit; launching anyway because train.force=true",
              file=sys.stderr)
    held.enter_context(checkpoint_dir_lock(cfg.train))
    flops_per_sample = training_flops_per_sample(workload.model_factory, workload,
                                                 checkpointing=plan.activation_checkpointing)
    ds_config = build_ds_config(plan, cfg.optim, cfg.train.steps, param_count=facts.param_count,
                                tp_layer_specs=workload.tp_layer_specs)
    job = TrainJob(plan=plan, ds_config=ds_config, workload=workload, train=cfg.train,
                   env={**worker_env(plan),
                        **collective_timeout_env(cfg.train.hang_timeout_s, cfg.train.setup_timeout_s)},
                   model_signature=signature_of(workload.model_factory, workload.model_config, cfg.train),
                   system_metrics_interval_s=cfg.tracking.system_metrics_interval_s if cfg.tracking.enabled else 0.0)
    group_spec = WorkerGroupSpec(world_size=plan.world_size, cpus_per_worker=cfg.cluster.cpus_per_worker,
                                 gpus_per_worker=1.0 if plan.accelerator == Accelerator.gpu else 0.0,
                                 env=job.env, wait_s=cfg.cluster.wait_s, tp=plan.tp,
                                 strategy=placement_strategy(cluster.nodes))
    result = TrainResult(run_id=None, plan=plan, model=facts, estimate=estimate)
    clock.mark("check")

    published = (resumable(cfg.train.checkpoint_dir, job.model_signature)
                 if cfg.train.resume == ResumeMode.auto else None)
    if published:
        job = _resume_from(job, cfg, published, out)
        print(f"resuming from {cfg.train.checkpoint_dir}/{job.resume_tag} (step {published.step})", file=out)

    tracker = None
    if cfg.tracking.enabled:
        cfg = reachable_tracking(cfg)
        if published and published.run_id:
            tracker = RunTracker.resume(uri=cfg.tracking.uri, run_id=published.run_id)
        else:
            tracker = _start_tracking(cfg, model_cfg, plan, facts, estimate, ds_config, config_yaml, tags or {})
            try:
                tracker.log_dataset(workload.data.describe())
            except Exception as error:  # noqa: BLE001 - a user's data source may raise anything
                print(f"note: the data was not logged as a dataset input ({type(error).__name__}: {error})",
                      file=sys.stderr)
        result.run_id = tracker.run_id
        job = dataclasses.replace(job, run_id=tracker.run_id)
    clock.mark("tracking")

    print(f"plan: dp={plan.dp} tp={plan.tp} pp={plan.pp} zero_stage={plan.zero_stage} "
          f"offload_optimizer={plan.offload_optimizer.value} offload_param={plan.offload_param.value} "
          f"activation_checkpointing={plan.activation_checkpointing} precision={plan.precision.value} "
          f"micro_batch_size={plan.micro_batch_size} grad_accum_steps={plan.grad_accum_steps} "
          f"on {plan.world_size} {plan.accelerator.value} workers; model {facts.param_count:,} parameters",
          file=out, flush=True)
    status = "FAILED"
    progress = Progress(cfg.train.steps)
    logged_step = published.step if published else 0
    try:
        streamed = isinstance(workload.data, StreamingSource)
        min_cpus = plan.world_size * cfg.cluster.cpus_per_worker + data_task_cpus(workload.data)
        with ray_session(cfg.cluster.address, min_cpus=min_cpus,
                         object_store_gib=cfg.cluster.object_store_memory_gib,
                         connect_timeout_s=cfg.cluster.connect_timeout_s):
            clock.mark("ray")
            failures = 0
            while True:
                group = WorkerGroup.create(group_spec)
                clock.mark("workers")
                try:
                    # A streamed source is split afresh for each attempt: a failed attempt's splits
                    # are left half-read by workers that are gone.
                    streams = workload.data.streams(plan.dp) if streamed else None
                    result.worker_facts = group.setup(job, timeout_s=cfg.train.setup_timeout_s, streams=streams)
                    clock.mark("setup")
                    built = result.worker_facts[0].built
                    if note := result.worker_facts[0].optimizer_note:
                        print(f"note: the optimizer is {note}", file=sys.stderr)
                    if built.startswith("whole (zero.Init failed"):
                        print(f"note: ZeRO-3 built the model {built}; every rank held the whole model "
                              "while building it", file=sys.stderr)
                    if tracker:
                        tracker.log_dict({"ranks": [{k: getattr(f, k) for k in _REALIZED_PLACEMENT}
                                                    for f in result.worker_facts]}, "plan/placement_realized.json")
                        tracker.set_tags({"nodes_used": str(len({f.node_id for f in result.worker_facts})),
                                          "peak_tflops_per_device": f"{_mean_peak(result.worker_facts):.4f}"})
                    on_system = SystemMetricsLog(tracker, result.worker_facts) if tracker else None
                    for reports in group.train(hang_timeout_s=cfg.train.hang_timeout_s, on_system=on_system):
                        if not result.reports:
                            clock.mark("first_report")
                            result.startup = dict(clock.phases)
                            if tracker:
                                tracker.log_metrics(clock.metrics(), reports[0]["step"])
                        result.reports.append(reports)
                        if on_report:
                            on_report(reports, result.worker_facts)
                        if reports[0]["step"] <= logged_step:
                            continue  # replayed after a restart: tracked the first time
                        logged_step = reports[0]["step"]
                        _report_step(reports, plan, progress, tracker, flops_per_sample,
                                     _mean_peak(result.worker_facts))
                    if tracker and cfg.train.export:
                        _export(group, workload, tracker, out)
                    break
                except (WorkerFailedError, WorkerHangError, RayActorError) as error:
                    if isinstance(error, WorkerHangError):
                        _save_stacks(error, tracker, failures + 1, out)
                    failures += 1
                    if failures > cfg.train.max_failures:
                        if isinstance(error, RayActorError):
                            raise WorkerDiedError(f"a worker died and train.max_failures={cfg.train.max_failures} "
                                                  f"restarts are used up: {error}") from error
                        raise
                    job = _prepare_restart(job, cfg, error, failures, logged_step, tracker, out)
                finally:
                    group.shutdown()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        progress.close()
        if tracker:
            tracker.finish(status)
            _log_plots(tracker)
        result.wall_s = time.perf_counter() - started
    _print_summary(result, tracker, out)
    return result


# What each rank reports of where it runs, logged next to the planned layout (plan/placement.json).
_REALIZED_PLACEMENT = ("rank", "node_id", "hostname", "pid", "dp_rank", "pp_rank", "tp_rank")


def reachable_tracking(cfg: RunConfig) -> RunConfig:
    """The config with a tracking URI that answers, falling back to a local store if asked to
    (only when no server answers: refused credentials or a wrong path are errors to fix)."""
    try:
        check_reachable(cfg.tracking.uri)
        return cfg
    except TrackingUnreachable as error:
        if cfg.tracking.fallback != "local":
            raise
        print(f"warning: {str(error).split(' Fix:')[0]}; tracking in sqlite:///mlflow.db instead "
              "(tracking.fallback=local)", file=sys.stderr)
        return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri="sqlite:///mlflow.db"))


def _log_plots(tracker: RunTracker) -> None:
    """Loss, throughput and memory pictures into the run's ``plots/`` (best effort)."""
    from orchestrator.report import write_plots

    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_plots(tracker.client, tracker.run_id, Path(tmp))
            tracker.client.log_artifacts(tracker.run_id, tmp, "plots")
    except Exception as exc:  # pictures are a convenience; the run's data is already recorded
        print(f"warning: could not log plots ({type(exc).__name__}: {exc})", file=sys.stderr)


def _mean_peak(worker_facts: list[WorkerFacts]) -> float:
    peaks = [f.peak_tflops for f in worker_facts]
    return sum(peaks) / len(peaks) if peaks else 0.0


def _start_tracking(cfg: RunConfig, model_cfg: dict, plan: ResolvedPlan, facts: ModelFacts,
                    estimate: PlanEstimate, ds_config: dict, config_yaml: str,
                    extra_tags: dict[str, str]) -> RunTracker:
    """A new MLflow run with the flattened resolved config as params and the configs as artifacts."""
    params = flatten({"plan": plan.as_dict(), "model": dict(model_cfg),
                      "data": dict(cfg.data), "objective": dict(cfg.objective), "optim": vars(cfg.optim),
                      "train": vars(cfg.train),
                      "cluster": {**vars(cfg.cluster), "address": address_param(cfg.cluster.address)}})
    params["model.param_count"] = str(facts.param_count)
    params.update({f"memory.predicted.{k}": str(v) for k, v in estimate.per_device.as_dict().items()})
    tags = {"world_size": str(plan.world_size), "devices": f"{plan.world_size}x{plan.accelerator.value}",
            "orch.command": "train", **extra_tags}
    if commit := git_commit():
        tags["git_commit"] = commit
    tracker = RunTracker.start(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                               run_name=cfg.tracking.run_name, params=params, tags=tags)
    tracker.log_text(redact_text(config_yaml), "config/resolved.yaml")  # cluster.address may hold a password
    tracker.log_dict(ds_config, "config/deepspeed.json")
    tracker.log_dict(estimate.as_json(), "plan/estimate.json")
    tracker.log_dict({"placement": rank_layout(plan.world_size, cfg.cluster.devices_per_node, plan.tp, plan.pp)},
                     "plan/placement.json")
    tracker.log_metrics({"memory/predicted_peak_bytes": estimate.per_device.total}, step=0)
    return tracker


class SystemMetricsLog:
    """Logs the nodes' hardware samples as MLflow names system metrics of several nodes:
    ``system/node<i>/<metric>``, nodes numbered in rank order, each node's samples its own steps.
    The ``system.node<i>`` tags name each node's host."""

    def __init__(self, tracker: RunTracker, worker_facts: list[WorkerFacts]):
        self.tracker = tracker
        self.node_of_rank: dict[int, int] = {}
        nodes: dict[str, int] = {}
        for fact in sorted(worker_facts, key=lambda f: f.rank):
            if fact.node_id not in nodes:
                nodes[fact.node_id] = len(nodes)
                tracker.set_tags({f"system.node{len(nodes) - 1}": fact.hostname or fact.node_id})
            self.node_of_rank[fact.rank] = nodes[fact.node_id]
        self.samples: dict[int, int] = {}

    def __call__(self, rank: int, samples: list[dict]) -> None:
        node = self.node_of_rank.get(rank, rank)
        for sample in samples:
            step = self.samples.get(node, 0)
            self.tracker.log_metrics({f"system/node{node}/{key}": value for key, value in sample.items()}, step=step)
            self.samples[node] = step + 1


def _export(group: WorkerGroup, workload, tracker: RunTracker, out) -> None:
    """Log the trained model to the run (plans without pipeline stages: see orchestrator/export.py)."""
    from orchestrator.export import log_trained_model

    exported = group.consolidated_state()
    if exported is None:
        print("note: the model is not exported from pipeline-parallel plans; its checkpoints hold the weights",
              file=out)
        return
    log_trained_model(tracker, workload, exported)
    print(f"model logged to the run: runs:/{tracker.run_id}/model/mlflow_model", file=out)


def _save_stacks(error: WorkerHangError, tracker: RunTracker | None, attempt: int, out) -> None:
    """Keep the evidence of a hang: every rank's Python stack, in the MLflow run."""
    print(f"hang: {error}", file=out, flush=True)
    if tracker:
        for rank, text in error.stacks.items():
            tracker.log_text(text, f"hangs/attempt{attempt}/rank{rank}.txt")
        tracker.set_tags({f"hang.{attempt}.ranks": ",".join(map(str, error.ranks))})


def _prepare_restart(job: TrainJob, cfg: RunConfig, error: Exception, failures: int, logged_step: int,
                     tracker: RunTracker | None, out) -> TrainJob:
    """Record why the group failed and point the next attempt at the latest published checkpoint."""
    cause = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    published = resumable(cfg.train.checkpoint_dir, job.model_signature) if cfg.train.checkpoint_every else None
    start = f"step {published.step}" if published else "the beginning (no checkpoint yet)"
    print(f"restart {failures}/{cfg.train.max_failures}: {type(error).__name__}: {cause}; resuming from {start}",
          file=out, flush=True)
    if tracker:
        tracker.set_tags({"restarts": str(failures), f"restart.{failures}.cause": f"{type(error).__name__}: {cause}",
                          f"restart.{failures}.resumed_from_step": str(published.step if published else 0)})
        tracker.log_metrics({"restarts": failures}, step=logged_step)
    if published is None:
        return dataclasses.replace(job, resume_tag=None)
    return _resume_from(job, cfg, published, out)


def _resume_from(job: TrainJob, cfg: RunConfig, published: Published, out) -> TrainJob:
    """The job pointed at ``published``: as written, or converted to a universal checkpoint when
    it was written at another dp degree (raises PlanError for changes nothing can bridge)."""
    config = {k: v for k, v in job.ds_config.items() if k != "checkpoint"}
    if not needs_universal(published.layout, job.plan):
        return dataclasses.replace(job, resume_tag=published.tag, ds_config=config)
    print(f"the checkpoint at step {published.step} was written with dp={published.layout['dp']}; converting it "
          f"to a universal checkpoint for dp={job.plan.dp}", file=out, flush=True)
    tag = convert_to_universal(cfg.train.checkpoint_dir, published.tag, env=job.env)
    return dataclasses.replace(job, resume_tag=tag, ds_config={**config, "checkpoint": {"load_universal": True}})


def _with_suggestions(estimate: PlanEstimate) -> list[Violation]:
    """The planner's violations, with the fixes it found folded into each one."""
    fixes = "; or ".join(estimate.suggestions) if estimate.suggestions else None
    return [dataclasses.replace(v, fix=f"{fixes or v.fix} (or set train.force=true to launch anyway)")
            for v in estimate.violations]


def address_param(address: str | None) -> str:
    """The Ray address as an MLflow param: `embedded` for the local Ray, credentials redacted."""
    return "embedded" if address is None else redact_uri(address)


def _report_step(reports: list[dict], plan: ResolvedPlan, progress: Progress, tracker: RunTracker | None,
                 flops_per_sample: int, peak_tflops: float) -> None:
    lead = reports[0]
    step_times = [r["step_time_s"] for r in reports]
    slowest = max(step_times)
    samples_per_s = plan.global_batch_size / slowest
    metrics = {
        "loss": lead["loss"], "lr": lead["lr"], "step_time_s": slowest,
        "samples_per_s": samples_per_s,
        "step_time_spread_s": slowest - min(step_times), "epoch": lead["epoch"],
    }
    tokens_per_s = None
    if "tokens_per_s" in lead:  # data with tokens: every rank of one replica reports its replica's tokens
        tokens_per_s = sum(r["tokens_per_s"] for r in reports) / plan.tp / plan.pp
        metrics["tokens_per_s"] = tokens_per_s
    # Every device does an equal share of the step's FLOPs (dp splits the batch, tp the layers).
    tflops = flops_per_sample * plan.global_batch_size / slowest / plan.world_size / 1e12
    metrics["tflops_per_device"] = tflops
    if peak_tflops > 0:
        metrics["mfu"] = tflops / peak_tflops
    metrics.update({key: value for key, value in lead.items() if key.startswith("eval_")})
    if "measured_peak_bytes" in lead:
        # The most loaded rank is what has to fit; the planner predicts that rank.
        metrics["memory/measured_peak_bytes"] = max(r["measured_peak_bytes"] for r in reports)
        metrics["memory/measured_state_bytes"] = max(r["measured_state_bytes"] for r in reports)
        for r in reports:
            metrics[f"memory/rank{r['rank']}/measured_peak_bytes"] = r["measured_peak_bytes"]
    if tracker:
        tracker.log_metrics(metrics, lead["step"])
    progress.update(lead["step"], lead["loss"], tokens_per_s if tokens_per_s is not None else samples_per_s,
                    lead.get("eval_loss"), unit="tok/s" if tokens_per_s is not None else "samples/s")


def _print_summary(result: TrainResult, tracker: RunTracker | None, out) -> None:
    last = result.reports[-1][0] if result.reports else {}
    lines = [f"done: {last.get('step', 0)} steps in {result.wall_s:.1f}s "
             f"(first report after {result.time_to_first_report_s:.1f}s"
             + (f": {describe_startup(result.startup)})" if result.startup else ")")]
    if last:
        lines.append(f"final loss {last['loss']:.4f}" + (f", eval loss {last['eval_loss']:.4f}"
                                                          if "eval_loss" in last else ""))
    if tracker:
        lines.append(f"MLflow run {tracker.run_id} in experiment {tracker.experiment_id} "
                     f"({redact_uri(tracker.uri)})")
        lines.append(f"open it: {tracker.ui_hint()}")
    print("\n".join(lines), file=out, flush=True)
