"""`orch train`: check the run, track it, train it.

:func:`run_training` reads as those three steps. :func:`check` checks everything the user
declared and builds the job (no worker exists yet), :func:`track` opens or resumes the MLflow run,
and :func:`train` runs attempts of the worker group until one finishes or the
:class:`FailurePolicy` gives up; the start-up work that overlaps them is :class:`Startup`'s. The
MLflow run is ended (FINISHED, FAILED or KILLED) whatever happens after it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray.exceptions import RayActorError

from orch.checking import live_cluster, resolve_inputs
from orch.config import RunConfig
from orch.launchers.checkpoint import Published, resumable
from orch.launchers.job import StepReport, TrainJob, WorkerFacts
from orch.launchers.worker_group import (
    GroupNotPlacedError,
    WorkerDiedError,
    WorkerFailedError,
    WorkerGroup,
    WorkerHangError,
)
from orch.plans.memory.estimate import PlanEstimate
from orch.plans.model.model_facts import ModelFacts
from orch.plans.model.workload import StreamingSource, Workload, data_task_cpus
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import ClusterSpec, ResumeMode
from orch.run.elastic import ElasticRun
from orch.run.prepare import PreparedJob, prepare_job, resume_from
from orch.run.progress import Progress
from orch.run.resume import checkpoint_dir_lock
from orch.run.startup import Startup, StartupClock
from orch.run.startup import describe as describe_startup
from orch.tracking.goodput import GoodputLedger
from orch.tracking.plan_slowdown import PlanWatch
from orch.tracking.step_metrics import MeasurementsOnce, mean_peak_tflops, step_metrics
from orch.tracking.stragglers import StragglerWatch, rank_phase_metrics

if TYPE_CHECKING:
    from orch.tracking.store import RunTracker


@dataclass
class TrainResult:
    """What a finished run reports back (the CLI prints it; tests assert on it)."""

    run_id: str | None
    plan: ResolvedPlan
    model: ModelFacts
    estimate: PlanEstimate
    reports: list[list[StepReport]] = field(default_factory=list)
    """Per logged step, the report of every rank."""
    worker_facts: list[WorkerFacts] = field(default_factory=list)
    wall_s: float = 0.0
    startup: dict[str, float] = field(default_factory=dict)
    """Seconds of each start-up phase (orch/run/startup.py), in the order they ran."""
    goodput: dict = field(default_factory=dict)
    """Where the run's wall time went, in total and by attempt (:meth:`orch.tracking.goodput.GoodputLedger.as_dict`)."""
    stragglers: list = field(default_factory=list)
    """The ranks named slow, in the order they were (:class:`orch.tracking.stragglers.Straggler`), and
    the steps slower than the plan predicts (:class:`orch.tracking.plan_slowdown.PlanSlowdown`)."""

    @property
    def time_to_first_report_s(self) -> float:
        """Launch to the first report: the start-up phases add up to it (0 if none arrived)."""
        return sum(self.startup.values())

    @property
    def final_loss(self) -> float:
        return self.reports[-1][0].loss

    @property
    def eval_loss(self) -> float | None:
        return self.reports[-1][0].evaluation.get("eval_loss")


@dataclass
class _LoggedStep:
    """The last step whose metrics are tracked, across attempts: steps replayed after a restart
    (from the checkpoint before the failure) are not logged twice."""

    step: int


@dataclass(frozen=True)
class FailurePolicy:
    """When a failed attempt of the worker group is retried: a worker that raised, hung or died
    restarts the group from the latest checkpoint, up to ``max_failures`` times (train.max_failures).
    Anything else (a plan error, an interrupt) ends the run at once."""

    max_failures: int
    restartable: tuple[type[BaseException], ...] = (WorkerFailedError, WorkerHangError, RayActorError)

    def gives_up(self, error: BaseException, failures: int) -> bool:
        """Whether the run ends after its ``failures``-th failed attempt ended with ``error``."""
        return not isinstance(error, self.restartable) or failures > self.max_failures


def run_training(cfg: RunConfig, model_cfg: dict, config_yaml: str, *, stream=None,
                 on_report: Callable[[list[StepReport], list[WorkerFacts]], None] | None = None,
                 tags: dict[str, str] | None = None, workload: Workload | None = None,
                 startup: Startup | None = None) -> TrainResult:
    """Train one declared run end to end and return its result: check it, track it, train it.

    Start-up steps that do not depend on each other overlap (:class:`Startup`). A value or plan
    arithmetic that is wrong is refused before Ray starts, and so is a wrong path when Ray was not
    started early; a refusal found while Ray starts (a path, the model check, the tracking store)
    comes without waiting for that Ray, shows nothing of it, and leaves it to be shut down
    (:func:`orch.launchers.ray_session.ray_session_in_background`). Nothing is tracked before every
    check passes.

    ``on_report(reports, worker_facts)`` is called for every logged step, replays included
    (tests use it to inject faults at a known step). ``tags`` go onto the new MLflow run
    (`orch tune` nests its trials under its own run with ``mlflow.parentRunId``). ``workload`` is
    one already resolved for this model, objective and data (`orch tune` resolves it once for all
    its trials, whose model is then built on ``meta`` once). ``startup`` is `orch train`'s, begun
    before torch was imported (:meth:`Startup.for_command`), which the caller's block ends;
    without one the run makes its own.
    """
    out = stream or sys.stdout
    with contextlib.ExitStack() as held, live_cluster(cfg, connect=True) as (cluster, notes):
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if startup is None:
            startup = held.enter_context(Startup(cfg))
        checked = check(cfg, model_cfg, cluster, workload, startup, held, out)
        tracker = track(checked, model_cfg, config_yaml, tags or {}, startup)
        result = train(checked, tracker, startup, on_report=on_report, out=out)
    _print_summary(result, tracker, out)
    return result


@dataclass(frozen=True, kw_only=True)
class CheckedRun:
    """A run every check passed: its job, pointed at the checkpoint it resumes from if any."""

    cfg: RunConfig
    """The run's config, with the tracking URI that answered
    (:func:`orch.tracking.train_run.opened_tracking`)."""
    prepared: PreparedJob
    job: TrainJob
    published: Published | None
    """The checkpoint resumed (train.resume=auto), or None."""
    model_cfg: dict
    cluster: ClusterSpec
    """The cluster the plan was checked against (the live one's facts, when there is an address)."""


def check(cfg: RunConfig, model_cfg: dict, cluster: ClusterSpec, workload: Workload | None, startup: Startup,
          held: contextlib.ExitStack, out) -> CheckedRun:
    """Every check of the run, Ray's start and MLflow's import overlapping them once the declared
    values are valid. The checkpoint directory is taken into ``held`` once the plan and inputs are
    known to be valid, so every problem with them is reported together; it is held until the run ends."""
    workload, plan = resolve_inputs(cfg, model_cfg, cluster, workload)
    startup.inputs_valid(plan, data_cpus=data_task_cpus(workload.data))
    prepared = prepare_job(cfg, model_cfg, cluster, workload=workload, plan=plan)
    held.enter_context(checkpoint_dir_lock(cfg.train))
    job, published = _resume_point(prepared.job, cfg, out)
    if cfg.tracking.enabled:
        cfg = startup.tracking_module().opened_tracking(cfg)  # a tracking URI that cannot be used is refused here too
    startup.checked()
    return CheckedRun(cfg=cfg, prepared=prepared, job=job, published=published, model_cfg=model_cfg, cluster=cluster)


def track(checked: CheckedRun, model_cfg: dict, config_yaml: str, tags: dict[str, str],
          startup: Startup) -> RunTracker | None:
    """The run's MLflow run (:func:`open_tracking`), or None when tracking is off."""
    tracker = None
    if checked.cfg.tracking.enabled:
        tracker = open_tracking(checked.cfg, model_cfg, checked.prepared, checked.published, config_yaml, tags)
    startup.tracked()
    return tracker


def train(checked: CheckedRun, tracker: RunTracker | None, startup: Startup, *, on_report, out) -> TrainResult:
    """Train the checked run once Ray is up; the MLflow run is ended FINISHED, FAILED or KILLED
    whatever happens."""
    prepared, cfg = checked.prepared, checked.cfg
    result = TrainResult(run_id=tracker.run_id if tracker else None, plan=prepared.plan, model=prepared.facts,
                         estimate=prepared.estimate)
    job = dataclasses.replace(checked.job, run_id=tracker.run_id) if tracker else checked.job
    _print_plan(prepared, out)
    status = "FAILED"
    progress = Progress(cfg.train.steps)
    ledger = GoodputLedger(started=startup.clock.started)
    try:
        startup.ray_up()
        elastic = (ElasticRun(cfg=cfg, model_cfg=checked.model_cfg, cluster=checked.cluster, declared=prepared)
                   if cfg.train.elastic.enabled else None)
        exported = _attempts(prepared, job, cfg, tracker, result, progress, startup.clock, ledger, elastic,
                             on_report=on_report, logged_step=checked.published.step if checked.published else 0,
                             out=out)
        startup.ray_done()
        if tracker and exported is not None:
            _log_export(prepared.workload, tracker, exported, out)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        progress.close()
        _record_goodput(ledger, result, tracker, out)
        if tracker:
            from orch.tracking.train_run import log_plots

            tracker.finish(status)
            log_plots(tracker)
        result.wall_s = time.perf_counter() - startup.clock.started
    return result


def _resume_point(job: TrainJob, cfg: RunConfig, out) -> tuple[TrainJob, Published | None]:
    """The job pointed at the newest intact checkpoint when train.resume=auto finds one."""
    published = (resumable(cfg.train.checkpoint_dir, job.model_signature)
                 if cfg.train.resume == ResumeMode.auto else None)
    if not published:
        return job, None
    job = resume_from(job, cfg, published, out)
    print(f"resuming from {cfg.train.checkpoint_dir}/{job.resume_tag} (step {published.step})", file=out)
    return job, published


def open_tracking(cfg: RunConfig, model_cfg: dict, prepared: PreparedJob, published: Published | None,
                  config_yaml: str, tags: dict[str, str]) -> RunTracker:
    """The run's MLflow run: the one a resumed checkpoint belongs to, or a new one with the
    config, the estimate and the dataset. ``cfg`` holds the tracking URI that answered
    (:func:`orch.tracking.train_run.opened_tracking`)."""
    from orch.tracking.store import RunTracker
    from orch.tracking.train_run import start_tracking

    if published and published.run_id:
        return RunTracker.resume(uri=cfg.tracking.uri, run_id=published.run_id)
    tracker = start_tracking(cfg, model_cfg, prepared.plan, prepared.facts, prepared.estimate,
                             prepared.job.optim, prepared.job.engine_config, config_yaml, tags,
                             predicted_step=prepared.predicted_step)
    try:
        tracker.log_dataset(prepared.workload.data.describe())
    except Exception as error:  # noqa: BLE001 - a user's data source may raise anything
        print(f"note: the data was not logged as a dataset input ({type(error).__name__}: {error})",
              file=sys.stderr)
    return tracker


def _print_plan(prepared: PreparedJob, out) -> None:
    plan = prepared.plan
    print(f"plan: {plan.layout_text()} on {plan.world_size} {plan.accelerator.value} workers; "
          f"model {prepared.facts.param_count:,} parameters",
          file=out, flush=True)


def _record_goodput(ledger: GoodputLedger, result: TrainResult, tracker: RunTracker | None, out) -> None:
    """Where the run's wall time went (:mod:`orch.tracking.goodput`): printed, kept on the result and,
    when tracked, as metrics and ``goodput.json``."""
    if not ledger.attempts:
        return
    now = time.perf_counter()
    result.goodput = ledger.as_dict(now)
    print(ledger.summary(now), file=out, flush=True)
    if tracker:
        step = result.reports[-1][0].step if result.reports else 0
        tracker.log_metrics(ledger.metrics(now), step)
        tracker.log_dict(result.goodput, "goodput.json")


def _attempts(prepared: PreparedJob, job: TrainJob, cfg: RunConfig, tracker: RunTracker | None, result: TrainResult,
              progress: Progress, clock: StartupClock, ledger: GoodputLedger, elastic: ElasticRun | None, *,
              on_report, logged_step: int, out) -> dict | None:
    """Attempts of the worker group until one finishes; a failed one restarts from the latest
    checkpoint while :class:`FailurePolicy` allows (steps replayed after a restart are not logged twice).
    An elastic run (``elastic``) that lost a worker restarts on the plan's devices if they come back in
    time, or re-plans for the survivors, and returns to its declared plan when they are back.
    Returns the trained model's consolidated state to log, if one is exported."""
    policy = FailurePolicy(cfg.train.max_failures)
    logged = _LoggedStep(logged_step)
    failures = 0
    current = prepared
    placed: WorkerGroup | None = None
    """A group the elastic wait already placed for the next attempt."""
    while True:
        ledger.attempt_started()
        group = placed or _placed_again(current, failures, elastic)
        placed = None
        clock.mark("workers")
        try:
            return _attempt(group, current, job, tracker, result, progress, clock, ledger, elastic,
                            on_report=on_report, logged=logged,
                            export=cfg.train.export and tracker is not None, out=out)
        except PlanChange:
            ledger.attempt_stopped("plan change")
            group.shutdown()
            started = time.perf_counter()
            placed, current, job = elastic.change_plan(current, job, steps_done=logged.step, tracker=tracker, out=out)
            ledger.replanned(time.perf_counter() - started)
        except Exception as error:
            ledger.attempt_failed(type(error).__name__)
            if isinstance(error, WorkerHangError):
                print(f"hang: {error}", file=out, flush=True)
                if tracker:
                    from orch.tracking.train_run import record_hang

                    record_hang(tracker, error, failures + 1)
            failures += 1
            if policy.gives_up(error, failures):
                if isinstance(error, RayActorError):
                    raise WorkerDiedError(f"a worker died and train.max_failures={cfg.train.max_failures} "
                                          f"restarts are used up: {error}") from error
                raise
            job, published = _prepare_restart(job, cfg, error, failures, logged.step, tracker, out)
            if elastic is not None and isinstance(error, RayActorError):
                group.shutdown()  # its devices are free before the group is placed again
                started = time.perf_counter()
                placed, current, job = elastic.recover(current, job, error, published, steps_done=logged.step,
                                                       tracker=tracker, out=out)
                ledger.replanned(time.perf_counter() - started)
        finally:
            group.shutdown()


def _placed_again(prepared: PreparedJob, failures: int, elastic: ElasticRun | None) -> WorkerGroup:
    """The attempt's worker group. One that cannot be placed after a failure is a failed run (exit 1),
    not a plan the cluster cannot hold: a node may have been lost, which an elastic run re-plans for."""
    try:
        return WorkerGroup.create(prepared.group_spec)
    except GroupNotPlacedError as error:
        if not failures or elastic is not None:
            raise
        raise WorkerDiedError(f"a worker was lost and the group could not be placed again: {error} A node may be "
                              "gone: train.elastic.enabled=true re-plans for the devices that survive") from error


class PlanChange(Exception):  # noqa: N818 - a signal between two functions of this module, not an error
    """An elastic run's group stopped at a checkpoint for a new plan: its declared devices are back, or a
    straggler's node is to be left out."""


def _attempt(group: WorkerGroup, prepared: PreparedJob, job: TrainJob, tracker: RunTracker | None,
             result: TrainResult, progress: Progress, clock: StartupClock, ledger: GoodputLedger,
             elastic: ElasticRun | None, *, on_report, logged: _LoggedStep, export: bool, out) -> dict | None:
    """One attempt: set the group up, train it to the end, gather the trained model when it is
    exported. ``logged`` advances as steps are tracked, and keeps its value when the attempt fails.
    Raises :class:`PlanChange` when an elastic run's group stopped at a checkpoint for another plan."""
    data = prepared.workload.data
    # A streamed source is split afresh for each attempt: a failed attempt's splits are left
    # half-read by workers that are gone.
    streams = None
    if isinstance(data, StreamingSource):
        eval_samples = job.train.eval_batches * job.plan.micro_batch_size * job.plan.dp
        streams = data.streams(job.plan.dp, eval_samples=eval_samples)
    result.worker_facts = group.setup(job, timeout_s=job.train.setup_timeout_s, streams=streams)
    clock.mark("setup")
    _note_setup(result.worker_facts, tracker, prepared.mfu_peak_source)
    on_system = None
    if tracker:
        from orch.tracking.train_run import SystemMetricsLog, record_stragglers

        on_system = SystemMetricsLog(tracker, result.worker_facts)
    peak_tflops = mean_peak_tflops(result.worker_facts)
    measurements = MeasurementsOnce()
    threshold = job.train.straggler_threshold
    stages = {facts.rank: facts.pp_rank for facts in result.worker_facts}
    hostnames = {facts.rank: facts.hostname for facts in result.worker_facts}
    watch = StragglerWatch(threshold, job.train.straggler_reports, hostnames, stages)
    plan_watch = None
    if prepared.slowdown_ratio is not None and prepared.predicted_step is not None:
        plan_watch = PlanWatch(prepared.predicted_step.as_dict()["parts_s"], prepared.slowdown_ratio, threshold,
                               job.train.straggler_reports, hostnames)
    stopping = False
    for reports in group.train(hang_timeout_s=job.train.hang_timeout_s, on_system=on_system):
        if not result.reports:
            clock.mark("first_report")
            result.startup = dict(clock.phases)
            if tracker:
                tracker.log_metrics(clock.metrics(), reports[0].step)
        result.reports.append(reports)
        ledger.reported(reports, redone=reports[0].step <= logged.step)
        if on_report:
            on_report(reports, result.worker_facts)
        if reports[0].step <= logged.step:
            continue  # replayed after a restart: tracked the first time
        logged.step = reports[0].step
        metrics = step_metrics(reports, job.plan, prepared.flops_per_sample, peak_tflops)
        metrics.update(rank_phase_metrics(reports, threshold, stages))
        if tracker:
            tracker.log_metrics(measurements.fresh(metrics), logged.step)
        if any(r.profiles for r in reports):
            from orch.tracking.profiles import record_profiles

            record_profiles(tracker, reports, out)
        if any(r.memory_at_peak for r in reports):
            from orch.tracking.memory_detail import record_memory_at_peak

            record_memory_at_peak(tracker, reports, out)
        slowdown = plan_watch.observe(reports) if plan_watch is not None else None
        straggler = watch.observe(reports)
        for named in (slowdown, straggler):
            if named is not None:
                result.stragglers.append(named)
                print(f"warning: {named.message()}", file=sys.stderr, flush=True)
                if tracker:
                    record_stragglers(tracker, result.stragglers)
        if straggler is not None and elastic is not None and elastic.spec.exclude_stragglers and not stopping:
            elastic.exclude(result.worker_facts[straggler.rank].node_id, straggler.message())
            group.stop_at_next_checkpoint()
            stopping = True
            print(f"elastic: leaving rank {straggler.rank}'s node out of the plan from the next checkpoint",
                  file=out, flush=True)
        tokens_per_s = metrics.get("tokens_per_s")
        progress.update(logged.step, metrics["loss"], tokens_per_s if tokens_per_s is not None
                        else metrics.get("samples_per_s"), metrics.get("eval_loss"),
                        unit="tok/s" if tokens_per_s is not None else "samples/s")
        if elastic is not None and not stopping and elastic.scale_up_ready(prepared):
            group.stop_at_next_checkpoint()
            stopping = True
            print(f"elastic: the cluster has {elastic.declared.group_spec.world_size} devices again; back to the "
                  "declared plan at the next checkpoint", file=out, flush=True)
    if stopping and result.reports and result.reports[-1][0].step < job.train.steps:
        raise PlanChange  # the group stopped at that checkpoint
    return _gather_export(group, out) if export else None


def _note_setup(worker_facts: list[WorkerFacts], tracker: RunTracker | None, peak_source: str) -> None:
    """Tell the user how the workers came up, and record where the ranks really run."""
    built = worker_facts[0].model.built
    if note := worker_facts[0].model.optimizer_note:
        print(f"note: the optimizer is {note}", file=sys.stderr)
    if built.startswith("whole (zero.Init failed"):
        print(f"note: ZeRO-3 built the model {built}; every rank held the whole model while building it",
              file=sys.stderr)
    if tracker:
        tracker.log_dict({"ranks": [{k: getattr(f, k) for k in _REALIZED_PLACEMENT} for f in worker_facts]},
                         "plan/placement_realized.json")
        tracker.set_tags({"nodes_used": str(len({f.node_id for f in worker_facts})),
                          "optimizer": worker_facts[0].model.optimizer,
                          "peak_tflops_per_device": f"{mean_peak_tflops(worker_facts):.6g}",
                          "peak_tflops_source": peak_source})


# What each rank reports of where it runs, logged next to the planned layout (plan/placement.json).
_REALIZED_PLACEMENT = ("rank", "node_id", "hostname", "pid", "dp_rank", "pp_rank", "tp_rank", "torch_threads")


def _gather_export(group: WorkerGroup, out) -> dict | None:
    """The trained model's consolidated state from the workers (plans without pipeline stages:
    see orch/export.py)."""
    exported = group.consolidated_state()
    if exported is None:
        print("note: the model is not exported from pipeline-parallel plans; its checkpoints hold the weights",
              file=out)
    return exported


def _log_export(workload, tracker: RunTracker, exported: dict, out) -> None:
    """Log the trained model to the run; needs no Ray, so it runs while an embedded Ray stops."""
    from orch.export import log_trained_model

    log_trained_model(tracker, workload, exported)
    print(f"model logged to the run: runs:/{tracker.run_id}/model/mlflow_model", file=out)


def _prepare_restart(job: TrainJob, cfg: RunConfig, error: Exception, failures: int, logged_step: int,
                     tracker: RunTracker | None, out) -> tuple[TrainJob, Published | None]:
    """Record why the group failed and point the next attempt at the latest published checkpoint, which is
    returned too (verifying it reads every file: an elastic re-plan resumes the same one)."""
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
        return dataclasses.replace(job, resume_tag=None), None
    return resume_from(job, cfg, published, out), published


def _print_summary(result: TrainResult, tracker: RunTracker | None, out) -> None:
    last = result.reports[-1][0] if result.reports else None
    lines = [f"done: {last.step if last else 0} steps in {result.wall_s:.1f}s "
             f"(first report after {result.time_to_first_report_s:.1f}s"
             + (f": {describe_startup(result.startup)})" if result.startup else ")")]
    if last:
        lines.append(f"final loss {last.loss:.4f}" + (f", eval loss {result.eval_loss:.4f}"
                                                       if result.eval_loss is not None else ""))
    if tracker:
        from orch.tracking.store import redact_uri

        lines.append(f"MLflow run {tracker.run_id} in experiment {tracker.experiment_id} "
                     f"({redact_uri(tracker.uri)})")
        lines.append(f"open it: {tracker.ui_hint()}")
    print("\n".join(lines), file=out, flush=True)
