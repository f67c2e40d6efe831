"""A training run in MLflow: the run opened with its params and configs, each logged step's
metrics, the nodes' hardware samples, hang evidence and the plots at the end.

The client-side mechanics (reaching a store, buffering metrics, credentials) are
:mod:`orch.tracking.store`; this module decides what a run of `orch train` records.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from orch.config import RunConfig
from orch.credentials import redact_text
from orch.launchers.job import WorkerFacts
from orch.launchers.placement import rank_layout
from orch.launchers.worker_group import WorkerHangError
from orch.plans.memory.estimate import PlanEstimate
from orch.plans.model.model_facts import ModelFacts
from orch.plans.optim_settings import OptimSettings
from orch.plans.resolve import ResolvedPlan
from orch.plans.step_time.cost_model import StepTime
from orch.tracking.step_prediction import predicted_step_params
from orch.tracking.store import (
    RunTracker,
    TrackingUnreachable,
    check_reachable,
    flatten,
    git_commit,
    open_client,
    redact_uri,
)


def reachable_tracking(cfg: RunConfig) -> RunConfig:
    """The config with a tracking URI that answers, falling back to a local store if asked to
    (only when no server answers: refused credentials or a wrong path are errors to fix)."""
    try:
        check_reachable(cfg.tracking.uri, timeout_s=cfg.cluster.connect_timeout_s)
        return cfg
    except TrackingUnreachable as error:
        if cfg.tracking.fallback != "local":
            raise
        print(f"warning: {str(error).split(' Fix:')[0]}; tracking in sqlite:///mlflow.db instead "
              "(tracking.fallback=local)", file=sys.stderr)
        return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri="sqlite:///mlflow.db"))


def opened_tracking(cfg: RunConfig) -> RunConfig:
    """:func:`reachable_tracking`, with the store opened (a new sqlite store is created and
    migrated then): a store MLflow cannot use is refused before any worker starts, and the run
    created while Ray starts finds the store open (MLflow keeps it for every client of the URI)."""
    cfg = reachable_tracking(cfg)
    open_client(cfg.tracking.uri)
    return cfg


def address_param(address: str | None) -> str:
    """The Ray address as an MLflow param: `embedded` for the local Ray, credentials redacted."""
    return "embedded" if address is None else redact_uri(address)


def start_tracking(cfg: RunConfig, model_cfg: dict, plan: ResolvedPlan, facts: ModelFacts,
                    estimate: PlanEstimate, optim: OptimSettings, engine_config: dict | None, config_yaml: str,
                    extra_tags: dict[str, str], predicted_step: StepTime | None = None) -> RunTracker:
    """A new MLflow run with the flattened resolved config as params and the configs as artifacts:
    the engine-neutral optimizer settings for every run, and the engine's own config when it has
    one (``config/<engine>.json``: DeepSpeed's JSON)."""
    from orch.plans.step_time.cost_model import speed_defaults
    from orch.plans.step_time.phases import correction_kind
    from orch.plans.step_time.prediction import plan_corrections
    from orch.plans.step_time.profile import cluster_speeds

    # A speed the cluster leaves unset is logged as the default the cost model takes for it (not
    # "None"), and the tag names those defaulted.
    defaulted = speed_defaults(cfg.cluster, plan.precision)
    params = flatten({"plan": plan.as_dict(), "model": dict(model_cfg),
                      "data": dict(cfg.data), "objective": dict(cfg.objective), "optim": vars(cfg.optim),
                      "train": vars(cfg.train),
                      "cluster": {**vars(cfg.cluster), **defaulted, "address": address_param(cfg.cluster.address),
                                  # A cluster profile's speeds, one param each (its matmul rates as JSON).
                                  "measured": measured_params(cfg.cluster.measured) if cfg.cluster.measured else None}})
    params["model.param_count"] = str(facts.param_count)
    params.update({f"memory.predicted.{k}": str(v) for k, v in estimate.per_device.as_dict().items()})
    if predicted_step is not None:
        speeds, _ = cluster_speeds(cfg.cluster, plan.precision)
        params.update(predicted_step_params(predicted_step, speeds.source, plan_corrections(plan, speeds),
                                            correction_kind(plan)))
    tags = {"world_size": str(plan.world_size), "devices": f"{plan.world_size}x{plan.accelerator.value}",
            "orch.command": "train", **extra_tags}
    if defaulted:
        tags["cluster.speeds_defaulted"] = f"{cfg.cluster.accelerator.value} defaults: " + ", ".join(defaulted)
    if commit := git_commit():
        tags["git_commit"] = commit
    tracker = RunTracker.start(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                               run_name=cfg.tracking.run_name, params=params, tags=tags)
    tracker.log_text(redact_text(config_yaml), "config/resolved.yaml")  # cluster.address may hold a password
    tracker.log_dict(optim.as_dict(), "config/optimizer.json")
    if engine_config is not None:
        tracker.log_dict(engine_config, f"config/{plan.engine}.json")
    tracker.log_dict(estimate.as_json(), "plan/estimate.json")
    placement = rank_layout(plan.world_size, cfg.cluster.devices_per_node, plan.tp, plan.pp, plan.cp)
    tracker.log_dict({"placement": placement},
                     "plan/placement.json")
    tracker.log_metrics({"memory/predicted_peak_bytes": estimate.per_device.total}, step=0)
    return tracker


class SystemMetricsLog:
    """Logs the nodes' hardware samples as MLflow names system metrics of several nodes:
    ``system/node<i>/<metric>``, nodes numbered in rank order, each sample at the training step the
    node's sampling rank had reached (never before the attempt's first step): a restarted or resumed
    run continues the steps of the one before, as its loss does. The ``system.node<i>`` tags name
    each node's host."""

    def __init__(self, tracker: RunTracker, worker_facts: list[WorkerFacts]):
        self.tracker = tracker
        self.node_of_rank: dict[int, int] = {}
        nodes: dict[str, int] = {}
        for fact in sorted(worker_facts, key=lambda f: f.rank):
            if fact.node_id not in nodes:
                nodes[fact.node_id] = len(nodes)
                tracker.set_tags({f"system.node{len(nodes) - 1}": fact.hostname or fact.node_id})
            self.node_of_rank[fact.rank] = nodes[fact.node_id]
        self.start_step = min((fact.start_step for fact in worker_facts), default=0)

    def __call__(self, rank: int, samples: list[dict], step: int = 0) -> None:
        node = self.node_of_rank.get(rank, rank)
        for sample in samples:
            self.tracker.log_metrics({f"system/node{node}/{key}": value for key, value in sample.items()},
                                     step=max(step, self.start_step))


def record_hang(tracker: RunTracker, error: WorkerHangError, attempt: int) -> None:
    """Keep the evidence of a hang: every rank's Python stack, in the MLflow run."""
    for rank, text in error.stacks.items():
        tracker.log_text(text, f"hangs/attempt{attempt}/rank{rank}.txt")
    tracker.set_tags({f"hang.{attempt}.ranks": ",".join(map(str, error.ranks))})


def record_stragglers(tracker: RunTracker, stragglers: list) -> None:
    """Keep the ranks named slow (:mod:`orch.tracking.stragglers`): a tag each, and all of them, in
    order, in ``events/stragglers.txt``."""
    latest = stragglers[-1]
    tracker.set_tags({f"straggler.{len(stragglers)}": latest.message()})
    tracker.log_text("\n".join(s.message() for s in stragglers) + "\n", "events/stragglers.txt")


def log_plots(tracker: RunTracker) -> None:
    """Loss, throughput and memory pictures into the run's ``plots/`` (best effort)."""
    from orch.tracking.report import write_plots

    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_plots(tracker.client, tracker.run_id, Path(tmp))
            tracker.client.log_artifacts(tracker.run_id, tmp, "plots")
    except Exception as exc:  # pictures are a convenience; the run's data is already recorded
        print(f"warning: could not log plots ({type(exc).__name__}: {exc})", file=sys.stderr)


def measured_params(measured) -> dict:
    """A cluster profile's ``measured`` section as run params: every speed, and how many finished
    runs correct it (their phases are in the profile file; as a param they would outgrow MLflow's
    limit on a param's length as runs are added)."""
    from orch.plans.step_time.profile import measured_values

    return {**measured_values(measured), "runs": len(measured.runs)}
