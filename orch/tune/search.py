"""`orch tune`: search the plan space, rank by predicted step time, confirm the best with short trials.

The pure work (enumeration, pruning, cost model) is :mod:`orch.plans.search.space` and
:mod:`orch.plans.step_time.cost_model`; this module prepares the search (the model probed once), measures the
cluster's speeds on Ray, and runs the search, the trials (:mod:`orch.tune.trials`), the plan
file (:mod:`orch.tune.plan_file`) and the tuning run (:mod:`orch.tune.tracking`) in order.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

from orch.checking import (
    check_model,
    check_pipeline,
    context_parallel_problem,
    fused_tp_layers,
    live_cluster,
    sequence_parallel_problem,
)
from orch.config import RunConfig
from orch.inputs import check_inputs, declared_violations
from orch.models import DEPTH_KEY, build_model, inspect_declared_model
from orch.plans.engines import engine_spec
from orch.plans.errors import PlanError, Violation
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import Workload, data_task_cpus
from orch.plans.resolve import ResolvedPlan
from orch.plans.search.space import (
    BatchScaledProbe,
    SearchContext,
    SearchSpace,
    plan_error_reason,
    search,
    trial_candidates,
)
from orch.plans.spec import Accelerator, Offload, Recompute
from orch.plans.step_time.cost_model import Speeds, fp8_speedup
from orch.plans.step_time.prediction import EXACT_PARAMS_LIMIT, count_model_cost
from orch.plans.step_time.profile import cluster_speeds, runs_range
from orch.tune.plan_file import check_plan_file, plan_overrides, write_plan_file
from orch.tune.result import TrainBudget, TuneResult
from orch.tune.tracking import finish_parent, start_parent
from orch.tune.trials import pick_winner, run_trial
from orch.workload import resolve_workload

if TYPE_CHECKING:
    from orch.launchers.calibration import Calibration


def declared_global_batch(cfg: RunConfig, world_size: int) -> int:
    """train.global_batch_size, or the declared plan's micro * accumulation * dp."""
    if cfg.train.global_batch_size:
        return cfg.train.global_batch_size
    return cfg.plan.micro_batch_size * cfg.plan.grad_accum_steps * _declared_dp(cfg, world_size)


def _declared_dp(cfg: RunConfig, world_size: int) -> int:
    return cfg.plan.dp or max(world_size // (cfg.plan.tp * cfg.plan.pp * cfg.plan.cp), 1)


def global_batch_origin(cfg: RunConfig, world_size: int) -> str:
    """Where the batch every plan is priced at comes from. Left to the declared plan, it grows with
    the cluster (a micro-batch of 8 on 2048 devices is 16384 sequences): the line says so, and how
    to hold another."""
    if cfg.train.global_batch_size:
        return "train.global_batch_size"
    return (f"the declared plan's micro-batch {cfg.plan.micro_batch_size} x accumulation "
            f"{cfg.plan.grad_accum_steps} x dp {_declared_dp(cfg, world_size)}; train.global_batch_size sets it")


def _space(cfg: RunConfig, world_size: int, supports_checkpointing: bool,
           selective_problem: str | None = None) -> SearchSpace:
    t = cfg.tune
    bad = [o for o in t.offload if o not in ("none", "cpu")]
    if bad:
        raise PlanError([Violation("tune.offload", bad, "the tuner offloads to none or cpu only.",
                                   "set tune.offload=[none,cpu] or a subset")])
    try:
        ckpt = tuple(dict.fromkeys(Recompute.of(value) for value in t.activation_checkpointing))
    except ValueError:
        raise PlanError([Violation("tune.activation_checkpointing", list(t.activation_checkpointing),
                                   "holds a value that is not a recomputation policy.",
                                   "set tune.activation_checkpointing=[none,selective,full] or a subset")]) from None
    from orch.plans.parallel.schedules import schedule_of

    try:
        kinds = [schedule_of(name) for name in t.pp_schedule]
    except ValueError:
        raise PlanError([Violation("tune.pp_schedule", list(t.pp_schedule), "holds a value that is not a pipeline "
                                   "schedule.", "set tune.pp_schedule to a subset of [gpipe,1f1b,interleaved_1f1b,"
                                   "zero_bubble,zbv]")]) from None
    if any(v < 2 for v in t.pp_virtual_stages):
        raise PlanError([Violation("tune.pp_virtual_stages", list(t.pp_virtual_stages),
                                   "the interleaved schedules run 2 or more stages per rank.",
                                   "set tune.pp_virtual_stages to values of 2 or more, e.g. [2,4]")])
    schedules = tuple(dict.fromkeys(
        (kind, v) for kind in kinds
        for v in ((2,) if kind.value == "zbv" else tuple(t.pp_virtual_stages) if kind.interleaved else (1,)))) or (
        (schedule_of("1f1b"), 1),)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in t.recompute_every_n_layers):
        raise PlanError([Violation("tune.recompute_every_n_layers", list(t.recompute_every_n_layers),
                                   "holds a value below 1.", "set tune.recompute_every_n_layers to values of 1 or "
                                   "more, e.g. [1,2,4]")])
    if not supports_checkpointing:
        ckpt = (Recompute.none,)
    elif selective_problem is not None:
        ckpt = tuple(policy for policy in ckpt if policy != Recompute.selective) or (Recompute.none,)
    return SearchSpace(world_size=world_size, global_batch_size=declared_global_batch(cfg, world_size),
                       precision=cfg.plan.precision, tp=tuple(t.tp) if t.tp else None,
                       pp=tuple(t.pp) if t.pp else None, zero_stages=tuple(t.zero_stages),
                       offload=tuple(Offload(o) for o in t.offload), activation_checkpointing=ckpt,
                       recompute_every_n_layers=tuple(dict.fromkeys(t.recompute_every_n_layers)) or (1,),
                       micro_batch_sizes=tuple(t.micro_batch_sizes) if t.micro_batch_sizes else None,
                       engines=tuple(t.engines),
                       reshard_after_forward=tuple(t.reshard_after_forward), compile=tuple(dict.fromkeys(t.compile)),
                       sequence_parallel=tuple(dict.fromkeys(t.sequence_parallel)),
                       async_tp=tuple(dict.fromkeys(t.async_tp)), fp8=tuple(dict.fromkeys(t.fp8)) or (False,),
                       pp_schedules=schedules)


CONTEXT_TOKENS_PER_RANK = 16384
"""The fewest tokens per rank the tuner splits a sequence down to by default (``tune.cp`` null)."""


def _context_degrees(declared: list[int] | None, seq_len: int | None) -> tuple[int, ...]:
    """``tune.cp``, or by default 1 and the powers of two up to 8 that leave each rank at least
    :data:`CONTEXT_TOKENS_PER_RANK` tokens of a ``seq_len`` sequence."""
    if declared:
        if any(c < 1 for c in declared):
            raise PlanError([Violation("tune.cp", list(declared), "holds a degree below 1.",
                                       "set tune.cp to degrees of 1 or more, e.g. [1,2,4]")])
        return tuple(dict.fromkeys(declared))
    found = [1]
    while seq_len and found[-1] < 8 and seq_len // (found[-1] * 2) >= CONTEXT_TOKENS_PER_RANK:
        found.append(found[-1] * 2)
    return tuple(found)


def _may_split_head(tune) -> bool:
    """Whether a plan of the search may split the output head over its tensor-parallel ranks
    (:func:`orch.plans.parallel.vocab_parallel.splits_head`): an engine that does is searched.
    Only then are the model's counts taken a second time with the head split."""
    return any(engine_spec(e).loss_parallel for e in tune.engines)


def prepare(cfg: RunConfig, model_cfg: dict, cluster, workload: Workload | None = None,
            ) -> tuple[SearchSpace, SearchContext]:
    """The search space and everything fixed during the search (the model probed once)."""
    workload = workload or resolve_workload(model_cfg, cfg.objective, cfg.data)
    constructor_cfg, tp_layer_specs = workload.model_config, workload.tp_layer_specs
    facts, shallow = inspect_declared_model(constructor_cfg, workload, cluster, cfg.plan.precision,
                                            Offload.none,  # the tuner offloads to the CPU at most
                                            factory=workload.model_factory)
    check_model(dataclasses.replace(facts, supports_activation_checkpointing=True, selective_problem=None), cfg,
                workload)
    large = facts.param_count >= EXACT_PARAMS_LIMIT
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

            shallow_depth = {DEPTH_KEY: SHALLOW_DEPTHS[0]} if shallow is not None else {}
            with meta_device():
                build_model({**constructor_cfg, "tp": tp, **shallow_depth})
        except Exception as exc:  # the model's own refusal, e.g. heads that do not split
            return f"the model refuses tp: {type(exc).__name__}"
        return None

    def plan_problem(plan: ResolvedPlan) -> str | None:
        if plan.tp > 1 and not engine_spec(plan.engine).splits_fused_tp_layers and fused_tp_layers(workload):
            return f"{plan.engine} cannot split the model's fused tensor-parallel layers"
        if plan.sequence_parallel and sequence_parallel_problem(probe, plan.tp, plan.pp):
            return "the model's sequence cannot be split over tp"
        if plan.cp > 1 and context_parallel_problem(probe, plan.cp, plan.tp, plan.sequence_parallel, plan.pp):
            return "the model's sequence cannot be split over cp"
        if plan.pp <= 1:
            return None
        try:
            check_pipeline(probe, plan, constructor_cfg, workload.pipeline_refusal)
        except PlanError as error:
            return plan_error_reason(error)
        return None

    ctx = SearchContext(cluster=cluster, train=cfg.train, optim=cfg.optim, probe=probe,
                        model_cost=count_model_cost(probe, tp_degrees, facts.param_count,
                                                    split_head=_may_split_head(cfg.tune)),
                        speeds=cluster_speeds(cluster, cfg.plan.precision)[0],
                        tp_problem=tp_problem, plan_problem=plan_problem)
    space = _space(cfg, cluster.world_size, facts.supports_activation_checkpointing, facts.selective_problem)
    space = dataclasses.replace(space, cp=_context_degrees(cfg.tune.cp, workload.tokens_per_sample))
    # Degrees the model cannot use are left out of the search rather than ranked as failures.
    if workload.pipeline_layers is None:
        space = dataclasses.replace(space, pp=(1,))
    if not tp_layer_specs:
        space = dataclasses.replace(space, tp=(1,))
    if cluster.accelerator != Accelerator.gpu:
        # Symmetric memory between a node's GPUs carries async TP's chunks; elsewhere it cannot run.
        space = dataclasses.replace(space, async_tp=(False,))
    if not fp8_speedup(cluster):
        space = dataclasses.replace(space, fp8=(False,))
    if sequence_parallel_problem(probe, tp=1):
        # A model whose sequence cannot be split at all (whatever the degrees: asked at tp=1)
        # keeps its tensor-parallel plans, unsplit.
        space = dataclasses.replace(space, sequence_parallel=(False,))
    return space, ctx


def matmul_shape(probe) -> tuple[int, int]:
    """(in, out) features of the largest linear layer inside the model's repeated layers."""
    import torch

    linears = [m for layer in probe.sample.modules() if isinstance(layer, torch.nn.ModuleList)
               for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    linears = linears or [m for m in probe.sample.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return 1024, 1024
    big = max(linears, key=lambda m: m.weight.numel())
    return big.in_features, big.out_features


def measure_cluster(cfg: RunConfig, cluster, space: SearchSpace, ctx: SearchContext, *,
                    use_cache: bool = True) -> Calibration:
    """The cluster's matmul, memory and all-reduce speeds, probed at the search's matmul shapes
    (or cached), with where each came from; what no probe can measure stays as declared."""
    from orch.launchers.calibration import calibrate
    from orch.launchers.worker_group import worker_env

    k, n = matmul_shape(ctx.probe)
    micro = sorted({spec.micro_batch_size for spec in space.plans()})
    rows = [m * ctx.model_cost.seq_len for m in micro][:8]
    gpu = cluster.accelerator == Accelerator.gpu
    env = worker_env(cluster.accelerator)
    return calibrate(world_size=cluster.world_size, devices_per_node=cluster.devices_per_node,
                     cpus_per_worker=cluster.cpus_per_worker, gpus_per_worker=1.0 if gpu else 0.0, env=env,
                     precision=cfg.plan.precision.value, rows=rows, k=k, n=n,
                     declared=Speeds.declared(cluster, cfg.plan.precision), cache_dir=cfg.tune.cache_dir,
                     wait_s=cluster.wait_s, use_cache=use_cache, attention=ctx.model_cost.attention_shape)


def measure_speeds(cfg: RunConfig, cluster, space: SearchSpace, ctx: SearchContext) -> tuple[Speeds, str]:
    """The cluster's measured speeds (or cached ones) and a note saying which."""
    calibration = measure_cluster(cfg, cluster, space, ctx)
    return dataclasses.replace(calibration.speeds, fp8_speedup=fp8_speedup(cluster)), calibration.note


def checked_workload(cfg: RunConfig, model_cfg: dict) -> Workload:
    """The declared model, objective and data resolved, and their inputs checked; a workload that
    cannot be resolved is reported with every other declared problem at once."""
    try:
        workload = resolve_workload(model_cfg, cfg.objective, cfg.data)
    except PlanError as error:
        raise PlanError(declared_violations(cfg) + error.violations) from None
    check_inputs(cfg, workload.data)
    return workload


def tune(cfg: RunConfig, model_cfg: dict, *, out=None, err=None) -> TuneResult:
    """Search, optionally calibrate and run trials, and write the winner; see the module docstring."""
    out = out or sys.stdout
    err = err or sys.stderr
    workload = checked_workload(cfg, model_cfg)
    check_plan_file(cfg)
    with ExitStack() as stack:
        cluster, notes = stack.enter_context(live_cluster(cfg))
        for note in notes:
            print(f"note: {note}", file=err)
        started = time.perf_counter()
        space, ctx = prepare(cfg, model_cfg, cluster, workload)
        print(f"tune: model probed on meta in {time.perf_counter() - started:.1f}s; searching {cluster.world_size} "
              f"{cluster.accelerator.value} devices, global batch {space.global_batch_size} "
              f"({global_batch_origin(cfg, cluster.world_size)})", file=err, flush=True)
        uses_ray = cfg.tune.trials > 0 or cluster.address is not None
        speeds, note = ctx.speeds, cluster_speeds(cluster, cfg.plan.precision)[1]
        if uses_ray:
            from orch.launchers.ray_session import ray_session
            from orch.launchers.worker_group import job_env
            from orch.run.early_ray import uses_object_store

            stack.enter_context(ray_session(cfg.cluster.address,
                                            worker_cpus=cluster.world_size * cluster.cpus_per_worker,
                                            data_cpus=data_task_cpus(workload.data),
                                            object_store_gib=cfg.cluster.object_store_memory_gib,
                                            connect_timeout_s=cfg.cluster.connect_timeout_s,
                                            worker_env=job_env(cluster.accelerator, cfg.train),
                                            object_store=uses_object_store(cfg)))
            # A cluster profile's speeds were measured on purpose (`orch calibrate`): kept, not re-measured.
            if cfg.tune.calibrate and speeds.source != "measured":
                print("tune: measuring the cluster's speeds on the Ray workers", file=err, flush=True)
                speeds, note = measure_speeds(cfg, cluster, space, ctx)
                ctx = dataclasses.replace(ctx, speeds=speeds)
        print(f"tune: speeds {note}", file=err, flush=True)
        result = TuneResult(search=search(space, ctx), speeds=speeds, speeds_note=note,
                            runs_range=runs_range(cluster.measured) if cluster.measured is not None else None,
                            global_batch_size=space.global_batch_size,
                            budget=TrainBudget.declared(cfg.train, cluster, space.global_batch_size,
                                                        ctx.probe.inputs.tokens_per_sample, cfg.plan.precision,
                                                        param_count=ctx.model_cost.param_count, optim=cfg.optim))
        if not result.search.ranked:
            raise PlanError([Violation("plan", "any", f"none of the {result.search.enumerated} plans of the search "
                                       f"space fits: {dict(result.search.rejected.most_common(5))}.",
                                       "use more or larger devices, a smaller model or a smaller global batch")])
        tracker = None
        if cfg.tune.trials > 0 and cfg.tracking.enabled:
            tracker = start_parent(cfg, model_cfg, cluster, result)
            result.parent_run_id = tracker.run_id
        status = "FAILED"
        try:
            from orch.launchers.worker_pool import reusing_workers

            with reusing_workers():  # a trial's workers serve the next one: their start-up is paid once
                for index, candidate in enumerate(trial_candidates(result.search.ranked, cfg.tune.trials), start=1):
                    result.trials.append(run_trial(cfg, model_cfg, candidate, index, ctx, result, err, workload))
            pick_winner(result)
            result.plan_file = write_plan_file(result.winner.plan, cfg, model_cfg, cluster, result)
            result.overrides = plan_overrides(result.winner.plan, cfg)
            status = "FINISHED"
        finally:
            if tracker:
                finish_parent(tracker, result, cfg, status)
    return result
