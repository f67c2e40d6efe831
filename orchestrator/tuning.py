"""`orch tune`: search the plan space, rank by predicted step time, confirm the best with short trials.

The pure work (enumeration, pruning, cost model) is :mod:`plans.search_space` and
:mod:`plans.cost_model`; this module wires it to the config, to Ray (calibration and trials, each
trial a full ``run_training`` with its own worker group, contained when it fails) and to MLflow
(one parent run, a nested run per trial), and writes the winner as a plan file.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import io
import json
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

import conf
from launchers.storage import RemoteDir, is_remote, location_violation
from orchestrator.checking import check_model, check_pipeline, live_cluster
from orchestrator.config import RunConfig
from orchestrator.inputs import check_inputs, declared_violations
from orchestrator.models import (
    DEPTH_KEY,
    build_model,
    inspect_declared_model,
)
from orchestrator.workload import resolve_workload
from plans.cost_model import Speeds
from plans.depth_scaling import SHALLOW_DEPTHS
from plans.errors import OrchError, PlanError, Violation
from plans.estimate import GIB
from plans.model_cost import measure_model_cost
from plans.resolve import ResolvedPlan
from plans.search_space import (
    BatchScaledProbe,
    Candidate,
    SearchContext,
    SearchResult,
    SearchSpace,
    plan_error_reason,
    plan_spec,
    search,
    trial_candidates,
)
from plans.spec import Accelerator, Offload, ResumeMode
from plans.workload import Workload, data_task_cpus

# Models above this many parameters get their activations measured at one micro-batch size and
# scaled (plans.search_space.BatchScaledProbe), and their FLOPs and activations counted at two
# shallow depths and extrapolated (plans.depth_scaling), as deep models (plans.depth_scaling.
# DEPTH_SCALED_FROM layers or more) always are; smaller ones are measured in full, in ms.
_EXACT_PARAMS_LIMIT = 1_000_000_000


class TrialTimeout(OrchError):
    """A trial ran past tune.trial_timeout_s."""


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
        candidates = [_candidate_json(c, tried.get(id(c))) for c in shown]
        best = None
        if self.winner:
            best = {**_candidate_json(self.winner, self.winner_trial),
                    "chosen_by": "measured" if self.winner_trial else "predicted",
                    "plan_file": str(self.plan_file) if self.plan_file else None, "overrides": self.overrides,
                    "train_command": train_command(self)}
        return {"global_batch_size": self.global_batch_size, "enumerated": self.search.enumerated,
                "feasible": len(self.search.ranked), "search_s": self.search.seconds,
                "rejected": dict(self.search.rejected.most_common()),
                "speeds": {**dataclasses.asdict(self.speeds), "note": self.speeds_note},
                "candidates": candidates, "best": best, "parent_run_id": self.parent_run_id}


def _candidate_json(c: Candidate, trial: Trial | None) -> dict:
    doc = {"plan": c.plan.as_dict(), "feasible": c.feasible,
           "predicted": {**c.predicted.as_dict(), "peak_bytes": c.estimate.per_device.total}}
    if trial is not None:
        doc["measured"] = trial.measured()
    return doc


def declared_global_batch(cfg: RunConfig, world_size: int) -> int:
    """train.global_batch_size, or the declared plan's micro * accumulation * dp."""
    if cfg.train.global_batch_size:
        return cfg.train.global_batch_size
    dp = cfg.plan.dp or max(world_size // (cfg.plan.tp * cfg.plan.pp), 1)
    return cfg.plan.micro_batch_size * cfg.plan.grad_accum_steps * dp


def _space(cfg: RunConfig, world_size: int, supports_checkpointing: bool) -> SearchSpace:
    t = cfg.tune
    bad = [o for o in t.offload if o not in ("none", "cpu")]
    if bad:
        raise PlanError([Violation("tune.offload", bad, "the tuner offloads to none or cpu only.",
                                   "set tune.offload=[none,cpu] or a subset")])
    ckpt = tuple(t.activation_checkpointing) if supports_checkpointing else (False,)
    return SearchSpace(world_size=world_size, global_batch_size=declared_global_batch(cfg, world_size),
                       precision=cfg.plan.precision, tp=tuple(t.tp) if t.tp else None,
                       pp=tuple(t.pp) if t.pp else None, zero_stages=tuple(t.zero_stages),
                       offload=tuple(Offload(o) for o in t.offload), activation_checkpointing=ckpt,
                       micro_batch_sizes=tuple(t.micro_batch_sizes) if t.micro_batch_sizes else None)


def prepare(cfg: RunConfig, model_cfg: dict, cluster, workload: Workload | None = None,
            ) -> tuple[SearchSpace, SearchContext]:
    """The search space and everything fixed during the search (the model probed once)."""
    workload = workload or resolve_workload(model_cfg, cfg.objective, cfg.data)
    constructor_cfg, tp_layer_specs = workload.model_config, workload.tp_layer_specs
    facts, shallow = inspect_declared_model(constructor_cfg, workload, cluster, cfg.plan.precision,
                                            Offload.none)  # the tuner offloads to the CPU at most
    check_model(dataclasses.replace(facts, supports_activation_checkpointing=True), cfg, workload)
    large = facts.param_count >= _EXACT_PARAMS_LIMIT
    probe = BatchScaledProbe(workload.model_factory, workload, tp_layer_specs=tp_layer_specs,
                             pipeline_layers=workload.pipeline_layers,
                             exact_up_to=1 if large else 64, depth_scaled=large, shallow=shallow)
    tp_degrees = [d for d in range(1, cluster.devices_per_node + 1) if cluster.devices_per_node % d == 0]

    @functools.cache
    def tp_problem(tp: int) -> str | None:
        if tp > 1 and not tp_layer_specs:
            return "the model has no tensor-parallel layer specs"
        if "n_head" in constructor_cfg:  # the built-in GPT's rule, without building the model
            return None if constructor_cfg["n_head"] % tp == 0 else "tp does not divide model.n_head"
        if "tp" not in constructor_cfg:
            return None
        try:
            import torch

            shallow_depth = {DEPTH_KEY: SHALLOW_DEPTHS[0]} if shallow is not None else {}
            with torch.device("meta"):
                build_model({**constructor_cfg, "tp": tp, **shallow_depth})
        except Exception as exc:  # the model's own refusal, e.g. heads that do not split
            return f"the model refuses tp: {type(exc).__name__}"
        return None

    def plan_problem(plan: ResolvedPlan) -> str | None:
        if plan.pp <= 1:
            return None
        try:
            check_pipeline(probe, plan, constructor_cfg, workload.pipeline_refusal)
        except PlanError as error:
            return plan_error_reason(error)
        return None

    ctx = SearchContext(cluster=cluster, train=cfg.train, optim=cfg.optim, probe=probe,
                        model_cost=measure_model_cost(probe, tp_degrees, depth_scaled=large or shallow is not None),
                        speeds=Speeds.declared(cluster),
                        tp_problem=tp_problem, plan_problem=plan_problem)
    space = _space(cfg, cluster.world_size, facts.supports_activation_checkpointing)
    # Degrees the model cannot use are left out of the search rather than ranked as failures.
    if workload.pipeline_layers is None:
        space = dataclasses.replace(space, pp=(1,))
    if not tp_layer_specs:
        space = dataclasses.replace(space, tp=(1,))
    return space, ctx


def _matmul_shape(probe) -> tuple[int, int]:
    """(in, out) features of the largest linear layer inside the model's repeated layers."""
    import torch

    linears = [m for layer in probe.sample.modules() if isinstance(layer, torch.nn.ModuleList)
               for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    linears = linears or [m for m in probe.sample.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return 1024, 1024
    big = max(linears, key=lambda m: m.weight.numel())
    return big.in_features, big.out_features


def measure_speeds(cfg: RunConfig, cluster, space: SearchSpace, ctx: SearchContext) -> tuple[Speeds, str]:
    """The cluster's matmul and all-reduce speeds, probed at the search's matmul shapes (or cached)."""
    from launchers.calibration import calibrate

    k, n = _matmul_shape(ctx.probe)
    micro = sorted({spec.micro_batch_size for spec in space.plans()})
    rows = [m * ctx.model_cost.seq_len for m in micro][:8]
    gpu = cluster.accelerator == Accelerator.gpu
    env = {"PYTHONUNBUFFERED": "1", **({} if gpu else {"DS_ACCELERATOR": "cpu"})}
    return calibrate(world_size=cluster.world_size, devices_per_node=cluster.devices_per_node,
                     cpus_per_worker=cluster.cpus_per_worker, gpus_per_worker=1.0 if gpu else 0.0, env=env,
                     precision=cfg.plan.precision.value, rows=rows, k=k, n=n, declared=ctx.speeds,
                     cache_dir=cfg.tune.cache_dir, wait_s=cluster.wait_s)


def tune(cfg: RunConfig, model_cfg: dict, *, out=None, err=None) -> TuneResult:
    """Search, optionally calibrate and run trials, and write the winner; see the module docstring."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        workload = resolve_workload(model_cfg, cfg.objective, cfg.data)
    except PlanError as error:
        raise PlanError(declared_violations(cfg) + error.violations) from None
    check_inputs(cfg, workload.data)
    check_plan_file(cfg)
    with ExitStack() as stack:
        cluster, notes = stack.enter_context(live_cluster(cfg))
        for note in notes:
            print(f"note: {note}", file=err)
        started = time.perf_counter()
        space, ctx = prepare(cfg, model_cfg, cluster, workload)
        print(f"tune: model probed on meta in {time.perf_counter() - started:.1f}s; searching {cluster.world_size} "
              f"{cluster.accelerator.value} devices, global batch {space.global_batch_size}", file=err, flush=True)
        uses_ray = cfg.tune.trials > 0 or cluster.address is not None
        speeds, note = ctx.speeds, "declared in the cluster config (cluster.device_tflops, ...)"
        if uses_ray:
            from launchers.ray_session import ray_session

            min_cpus = cluster.world_size * cluster.cpus_per_worker + data_task_cpus(workload.data)
            stack.enter_context(ray_session(cfg.cluster.address, min_cpus=min_cpus,
                                            object_store_gib=cfg.cluster.object_store_memory_gib,
                                            connect_timeout_s=cfg.cluster.connect_timeout_s))
            if cfg.tune.calibrate:
                print("tune: measuring the cluster's speeds on the Ray workers", file=err, flush=True)
                speeds, note = measure_speeds(cfg, cluster, space, ctx)
                ctx = dataclasses.replace(ctx, speeds=speeds)
        print(f"tune: speeds {note}", file=err, flush=True)
        result = TuneResult(search=search(space, ctx), speeds=speeds, speeds_note=note,
                            global_batch_size=space.global_batch_size)
        if not result.search.ranked:
            raise PlanError([Violation("plan", "any", f"none of the {result.search.enumerated} plans of the search "
                                       f"space fits: {dict(result.search.rejected.most_common(5))}.",
                                       "use more or larger devices, a smaller model or a smaller global batch")])
        tracker = None
        if cfg.tune.trials > 0 and cfg.tracking.enabled:
            tracker = _start_parent(cfg, model_cfg, cluster, result)
            result.parent_run_id = tracker.run_id
        status = "FAILED"
        try:
            for index, candidate in enumerate(trial_candidates(result.search.ranked, cfg.tune.trials), start=1):
                result.trials.append(run_trial(cfg, model_cfg, candidate, index, ctx, result, err))
            _pick_winner(result)
            result.plan_file = write_plan_file(result.winner.plan, cfg, model_cfg, cluster, result)
            result.overrides = plan_overrides(result.winner.plan, cfg)
            status = "FINISHED"
        finally:
            if tracker:
                _finish_parent(tracker, result, cfg, status)
    return result


def _pick_winner(result: TuneResult) -> None:
    measured = [t for t in result.trials if t.status == "ok"]
    if measured:
        best = max(measured, key=lambda t: t.tokens_per_s)
        result.winner, result.winner_trial = best.candidate, best
    else:
        result.winner = result.search.ranked[0]


def _trial_config(cfg: RunConfig, plan: ResolvedPlan, index: int, parent_name: str) -> RunConfig:
    steps = max(cfg.tune.trial_steps, 3)

    def within_trial(limit_s: float) -> float:
        """A train limit capped at the trial's (0, no limit, becomes the trial's)."""
        return min(limit_s or cfg.tune.trial_timeout_s, cfg.tune.trial_timeout_s)

    train = dataclasses.replace(cfg.train, steps=steps, log_every=1, eval_every=0, eval_batches=1,
                                memory_probe_step=2, checkpoint_every=0, resume=ResumeMode.never, max_failures=0,
                                global_batch_size=plan.global_batch_size,
                                hang_timeout_s=within_trial(cfg.train.hang_timeout_s),
                                setup_timeout_s=within_trial(cfg.train.setup_timeout_s))
    tracking = dataclasses.replace(cfg.tracking, run_name=f"{parent_name}-trial{index}")
    return dataclasses.replace(cfg, plan=plan_spec(plan), train=train, tracking=tracking)


def run_trial(cfg: RunConfig, model_cfg: dict, candidate: Candidate, index: int, ctx: SearchContext,
              result: TuneResult, err) -> Trial:
    """One candidate as a short real run; any failure is caught, reported and recorded."""
    from orchestrator.driver import run_training

    plan = candidate.plan
    trial = Trial(index=index, candidate=candidate)
    total = min(cfg.tune.trials, len(result.search.ranked)) if cfg.tune.trials else len(result.search.ranked)
    print(f"tune: trial {index}/{total}: {describe(plan)} (predicted {candidate.predicted.total_s:.3g} s/step)",
          file=err, flush=True)
    trial_cfg = _trial_config(cfg, plan, index, cfg.tracking.run_name or "tune")
    trial_model = {**model_cfg, "tp": plan.tp} if "tp" in model_cfg else model_cfg
    yaml = OmegaConf.to_yaml(OmegaConf.create({"model": trial_model, "plan": _plan_values(plan),
                                               "train": dataclasses.asdict(trial_cfg.train)}))
    started = time.perf_counter()

    def deadline(_reports, _facts) -> None:
        if time.perf_counter() - started > cfg.tune.trial_timeout_s:
            raise TrialTimeout(f"trial {index} ran past tune.trial_timeout_s={cfg.tune.trial_timeout_s:g}")

    tags = {"orch.tune.trial": str(index)}
    if result.parent_run_id:
        tags["mlflow.parentRunId"] = result.parent_run_id
    try:
        run = run_training(trial_cfg, trial_model, yaml, stream=err, on_report=deadline, tags=tags)
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
    timed = [reports for reports in run.reports if reports[0]["step"] not in (1, trial_cfg.train.memory_probe_step)]
    step_time = statistics.median(max(r["step_time_s"] for r in reports) for reports in (timed or run.reports))
    flops = (ctx.model_cost.flops_per_sample_checkpointed if plan.activation_checkpointing
             else ctx.model_cost.flops_per_sample)
    trial.status = "ok"
    trial.step_time_s = step_time
    trial.tokens_per_s = plan.global_batch_size * ctx.model_cost.seq_len / step_time
    trial.tflops_per_device = flops * plan.global_batch_size / step_time / plan.world_size / 1e12
    peaks = [r.get("measured_peak_bytes") for reports in run.reports for r in reports if "measured_peak_bytes" in r]
    trial.peak_bytes = max(peaks) if peaks else None
    print(f"tune: trial {index}: measured {trial.step_time_s:.3g} s/step, {trial.tokens_per_s:,.0f} tokens/s "
          f"(predicted {candidate.predicted.total_s:.3g} s/step)", file=err, flush=True)
    return trial


def _trial_run_id(cfg: RunConfig, parent_id: str | None, index: int) -> str | None:
    """The MLflow run a failed trial left behind (run_training raised before returning it)."""
    if not parent_id:
        return None
    from orchestrator.tracking import open_client

    client = open_client(cfg.tracking.uri)
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}' and "
                                            f"tags.`orch.tune.trial` = '{index}'")
    return runs[0].info.run_id if runs else None


def describe(plan: ResolvedPlan) -> str:
    off = plan.offload_optimizer.value + ("+param" if plan.offload_param != Offload.none else "")
    return (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} zero={plan.zero_stage} offload={off} "
            f"ckpt={'on' if plan.activation_checkpointing else 'off'} micro={plan.micro_batch_size} "
            f"accum={plan.grad_accum_steps}")


def _plan_values(plan: ResolvedPlan) -> dict:
    spec = plan_spec(plan)
    return {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(spec).items()}


def plan_overrides(plan: ResolvedPlan, cfg: RunConfig) -> list[str]:
    """The winner as `orch train` overrides (every field, so no default can differ)."""
    values = _plan_values(plan)
    out = [f"plan.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
           for k, v in values.items()]
    if cfg.train.global_batch_size:
        out.append(f"train.global_batch_size={cfg.train.global_batch_size}")
    return out


TUNED_PLANS_DIR = Path("tuned_plans")
"""Where tuned plans go by default, under the current directory: ``tuned_plans/plan/<tune.name>.yaml``,
a config directory Hydra adds to its search path with ``--config-dir tuned_plans``. Never inside the
installed package (site-packages, or the checkout of an editable install)."""


def plan_file_path(cfg: RunConfig) -> Path:
    """The local plan file (see :func:`write_plan_file` for ``tune.out`` on object storage)."""
    if cfg.tune.out:
        return Path(cfg.tune.out).expanduser()
    return TUNED_PLANS_DIR / "plan" / f"{cfg.tune.name}.yaml"


def _config_dir(plan_file: Path) -> Path | None:
    """The config directory that makes ``plan_file`` the option ``plan=<its stem>`` (its parent's
    parent, when its parent is named ``plan``), else None."""
    return plan_file.parent.parent if plan_file.parent.name == "plan" else None


def check_plan_file(cfg: RunConfig) -> None:
    """Refuse a plan file name that a shipped plan would shadow: Hydra looks in the package's
    conf/ before a ``--config-dir``, so ``plan=<name>`` would compose the shipped plan instead
    (and the plan schema, which every plan file extends, would extend itself)."""
    from hydra.core.config_store import ConfigStore

    if cfg.tune.out and is_remote(cfg.tune.out):
        problem = location_violation(_remote_parent(cfg.tune.out)[0])
        if problem:
            why, _, fix = problem.partition(" Fix: ")
            raise PlanError([Violation("tune.out", cfg.tune.out, f"its directory {why}", fix)])
        return
    path = plan_file_path(cfg)
    shipped = Path(conf.__file__).resolve().parent / "plan" / path.name
    registered = path.name in ConfigStore.instance().repo.get("plan", {})
    if _config_dir(path) is None or not (shipped.exists() or registered):
        return
    if cfg.tune.out:
        field_name, value, fix = "tune.out", cfg.tune.out, "give the file another name"
    else:
        field_name, value, fix = "tune.name", cfg.tune.name, "choose another name (tune.name=...)"
    raise PlanError([Violation(field_name, value, f"plan={path.stem} names a plan shipped with orch; the tuned "
                               "plan could not be selected by that name.", fix)])


def train_command(result: TuneResult) -> str | None:
    """The `orch train` command line that trains the winner from its plan file, if it is usable as
    ``plan=<name>``; relative paths stay relative, as the user gave them (or as the default is)."""
    root = _config_dir(result.plan_file) if isinstance(result.plan_file, Path) else None
    if root is None:
        return None
    batch = [o for o in result.overrides if o.startswith("train.global_batch_size=")]
    return " ".join(["orch train", "--config-dir", shlex.quote(str(root)),
                     f"plan={shlex.quote(result.plan_file.stem)}", *batch])


def write_plan_file(plan: ResolvedPlan, cfg: RunConfig, model_cfg: dict, cluster, result: TuneResult) -> Path | str:
    """The winner as a plan file that extends the plan schema, like the shipped ones; written to
    object storage when ``tune.out`` is a URI (a submitted tune's result, out of the job's
    working directory)."""
    how = (f"measured {result.winner_trial.tokens_per_s:,.0f} tokens/s in a trial"
           if result.winner_trial else f"predicted {result.winner.predicted.tokens_per_s:,.0f} tokens/s")
    header = (f"# Written by `orch tune` on {datetime.date.today()} for {model_cfg.get('_target_', 'the model')} "
              f"on {cluster.nodes} node(s) x {cluster.devices_per_node} {cluster.accelerator.value} device(s), "
              f"global batch {result.global_batch_size}:\n# {how}.\n")
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": ["plan_schema", "_self_"], **_plan_values(plan)}))
    result.plan_text = header + body
    if cfg.tune.out and is_remote(cfg.tune.out):
        directory, name = _remote_parent(cfg.tune.out)
        RemoteDir(directory).write_text(name, result.plan_text)
        return cfg.tune.out
    path = plan_file_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.plan_text)
    return path


def _remote_parent(uri: str) -> tuple[str, str]:
    """``s3://bucket/dir/plan.yaml`` → ``("s3://bucket/dir", "plan.yaml")``."""
    directory, _, name = uri.rstrip("/").rpartition("/")
    return directory, name


# --- rendering -------------------------------------------------------------------------------------

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


# --- MLflow ----------------------------------------------------------------------------------------

def _start_parent(cfg: RunConfig, model_cfg: dict, cluster, result: TuneResult):
    from orchestrator.driver import address_param, reachable_tracking
    from orchestrator.tracking import RunTracker, flatten, git_commit

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


def _finish_parent(tracker, result: TuneResult, cfg: RunConfig, status: str) -> None:
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


def to_json_text(result: TuneResult, top_k: int) -> str:
    buffer = io.StringIO()
    json.dump(result.as_json(top_k), buffer, indent=2, default=str)
    return buffer.getvalue()
