"""`orch check`: the planner's verdict on a declared plan, as a table or as JSON.

`orch train` runs the same check before any worker starts and refuses a plan that
does not fit unless ``train.force=true``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from orch.config import RunConfig
from orch.inputs import declared_violations, validated_plan
from orch.launchers.placement import rank_layout
from orch.models import inspect_declared_model
from orch.plans.cluster_facts import reconcile
from orch.plans.engines import engine_names, engine_spec
from orch.plans.errors import PipelineRefused, PlanError, Violation
from orch.plans.memory.estimate import GIB, ModelProbe, PlanEstimate, check_plan
from orch.plans.model.model_facts import ModelFacts
from orch.plans.model.workload import Workload
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, ClusterSpec, Offload, Precision, Recompute
from orch.plans.step_time.cost_model import DECLARED_CPU_ADAM_PARAMS_PER_THREAD_S, StepTime, fp8_speedup, host_threads
from orch.plans.step_time.prediction import declared_step_range
from orch.plans.step_time.profile import cluster_speeds
from orch.workload import resolve_workload


def check_model(facts: ModelFacts, cfg: RunConfig, workload: Workload) -> None:
    """What the model must offer whatever the layout (outputs for the data, checkpointing if asked);
    `check` and `tune` share it."""
    problems = []
    needed = workload.data.required_outputs
    if needed is not None and facts.output_size < needed:
        problems.append(Violation(_output_size_field(workload.model_config), facts.output_size,
                                  f"the data needs {needed} outputs per position (its vocabulary or classes: "
                                  f"token ids or labels up to {needed - 1}), the model has {facts.output_size}.",
                                  f"make the model's output size {needed} or more"))
    try:
        recompute = Recompute.of(cfg.plan.activation_checkpointing)
    except ValueError:  # refused with its fix by the plan's own check
        recompute = Recompute.none
    if recompute and not facts.supports_activation_checkpointing:
        problems.append(Violation("plan.activation_checkpointing", recompute.value,
                                  "the model has no gradient_checkpointing_enable() method and no repeated blocks "
                                  "to checkpoint (ModuleList items, or a Sequential of blocks of one class).",
                                  "implement gradient_checkpointing_enable() on the model, or set "
                                  "plan.activation_checkpointing=none"))
    elif recompute == Recompute.selective and facts.selective_problem:
        problems.append(Violation("plan.activation_checkpointing", recompute.value, f"{facts.selective_problem}.",
                                  "accept gradient_checkpointing_kwargs in the model's gradient_checkpointing_enable "
                                  "and pass them to torch.utils.checkpoint, or set plan.activation_checkpointing=full"))
    if problems:
        raise PlanError(problems)


# Where a model's output size is set, by the names the shipped models use.
_OUTPUT_SIZE_KEYS = ("vocab_size", "num_classes", "num_labels")


def _output_size_field(model_cfg: dict) -> str:
    for key in _OUTPUT_SIZE_KEYS:
        if key in model_cfg:
            return f"model.{key}"
    config = model_cfg.get("config")
    if isinstance(config, dict) and "vocab_size" in config:
        return "model.config.vocab_size"
    return "model"


def check_tensor_parallel(probe: ModelProbe, plan: ResolvedPlan, workload: Workload) -> None:
    """``plan.tp > 1`` needs layer specs for this model, and specs that shard some of its layers."""
    target = workload.model_config.get("_target_", "the model")
    if workload.tp_layer_specs is None:
        raise PlanError([Violation("plan.tp", plan.tp,
                                   f"{target} declares no tensor-parallel plan: no model.tp_layer_specs, no "
                                   "tp_layer_specs on its class and no tensor-parallel plan of its own.",
                                   "set plan.tp=1, or declare model.tp_layer_specs (DeepSpeed AutoTP layer specs)")])
    if probe.tensor_parallel_params[0] == 0:
        raise PlanError([Violation("plan.tp", plan.tp,
                                   f"the tensor-parallel layer specs ({workload.tp_specs_source}) match no layer of "
                                   f"{target}: every rank would hold and compute the whole model.",
                                   "set plan.tp=1, or fix the specs' patterns (regexes of parameter names)")])
    if not engine_spec(plan.engine).splits_fused_tp_layers and (fused := fused_tp_layers(workload)):
        able = [name for name in engine_names() if engine_spec(name).splits_fused_tp_layers]
        raise PlanError([Violation("plan.tp", plan.tp,
                                   f"the tensor-parallel layer specs ({workload.tp_specs_source}) split fused layers "
                                   f"({', '.join(map(str, fused))}), which plan.engine={plan.engine} cannot shard: its "
                                   "column- and row-wise styles split a weight evenly and would mix the fused parts.",
                                   f"set plan.engine={' or '.join(able)} (which split fused layers), or plan.tp=1")])
    if plan.sequence_parallel:
        check_sequence_parallel(probe, plan, target)


def check_sequence_parallel(probe: ModelProbe, plan: ResolvedPlan, target: str = "the model") -> None:
    """``plan.sequence_parallel``: the model has the blocks it splits the sequence between, and its
    sequence divides evenly over the tensor-parallel ranks."""
    if problem := sequence_parallel_problem(probe, plan.tp, plan.pp):
        raise PlanError([Violation("plan.sequence_parallel", True, f"{target}: {problem}.",
                                   "set plan.sequence_parallel=false")])


def sequence_parallel_problem(probe: ModelProbe, tp: int, pp: int = 1) -> str | None:
    """Why ``probe``'s model cannot split its sequence ``tp`` ways (in ``pp`` pipeline stages), or None."""
    layout = probe.sequence_parallel
    if isinstance(layout, str):
        return layout
    if pp > 1 and not probe.pipeline_takes_split_sequence:
        return ("its pipeline layers do not take a split sequence (no layer class has a sequence_shards attribute, "
                "which the Hugging Face decoders' have)")
    tokens = probe.inputs.tokens_per_sample
    if not tokens:
        return "its samples have no sequence dimension to split"
    if tokens % tp:
        return (f"its sequence of {tokens} does not split evenly over plan.tp={tp} ranks "
                f"({tokens} % {tp} = {tokens % tp})")
    return None


def check_context_parallel(probe: ModelProbe, plan: ResolvedPlan, target: str = "the model") -> None:
    """``plan.cp > 1``: the model runs on a part of the sequence (it takes the tokens' positions),
    and the sequence cuts into ``2 * cp`` equal chunks."""
    if problem := context_parallel_problem(probe, plan.cp, plan.tp, plan.sequence_parallel, plan.pp):
        raise PlanError([Violation("plan.cp", plan.cp, f"{target}: {problem}.", "set plan.cp=1")])


def context_parallel_problem(probe: ModelProbe, cp: int, tp: int = 1, sequence_parallel: bool = False,
                             pp: int = 1) -> str | None:
    """Why ``probe``'s model cannot split each sample's sequence over ``cp`` ranks (in ``pp``
    pipeline stages), or None."""
    from orch.plans.parallel.context_parallel import forward_problem, sequence_problem

    tokens = probe.inputs.tokens_per_sample
    if not tokens:
        return "its samples have no sequence dimension to split"
    if pp > 1 and not probe.pipeline_takes_positions:
        return ("its pipeline layers take no positions of a part of the sequence (no layer class has a "
                "context_positions attribute, which the built-in GPT's embedding and the Hugging Face decoders' "
                "layers have)")
    return forward_problem(probe.sample) or sequence_problem(tokens, cp, tp, sequence_parallel)


def fused_tp_layers(workload: Workload) -> list[list[str]]:
    """The patterns of the layer specs that split a fused weight (q, k and v stacked: ``shape`` or
    ``partition_dim``), which FSDP2's tensor parallelism cannot: DTensor's column- and row-wise
    styles split a weight evenly along one dimension. A Hugging Face model's own plan is used by
    the FSDP2 engine instead of specs, and splits no fused weight."""
    if (workload.tp_specs_source or "").endswith("own tensor-parallel plan"):
        return []
    return [spec["patterns"] for spec in workload.tp_layer_specs or []
            if spec.get("partition_type") != "skip" and ("shape" in spec or "partition_dim" in spec)]


def check_pipeline(probe: ModelProbe, plan: ResolvedPlan, model_cfg: dict,
                   refusal: str | None = None) -> None:
    """The model can be split into ``plan.pp`` stages that each get layers with parameters."""
    target = model_cfg.get("_target_", "the model")
    if probe.pipeline_layers is None:
        reason = refusal or f"{target} cannot be split into pipeline stages"
        raise PlanError([Violation("plan.pp", plan.pp, f"{reason}.",
                                   "set plan.pp=1, or give the model a pipeline_layers() classmethod "
                                   "(see orch/workloads/gpt.py)")])
    try:
        layers = probe.pipeline_layer_facts(plan)
    except PipelineRefused as error:
        raise PlanError([Violation("plan.pp", plan.pp,
                                   f"{target} cannot be split into pipeline stages by its pipeline_layers(): {error}.",
                                   "set plan.pp=1, or use a model whose pipeline_layers() accepts it "
                                   "(see docs/workloads.md)")]) from None
    if problem := engine_spec(plan.engine).pipeline_layer_problem(probe.pipeline_sample):
        raise PlanError([Violation("plan.pp", plan.pp, f"{target}'s pipeline_layers(): {problem}.",
                                   "give each StageLayer the module's class (its arguments in args and kwargs), "
                                   "or set plan.pp=1")])
    empty = [stage.index for stage in probe.stages(plan) if stage.trainable == 0]
    if empty:
        weighted = sum(1 for layer in layers if layer.trainable)
        raise PlanError([Violation("plan.pp", plan.pp,
                                   f"{target} has {len(layers)} pipeline layers, {weighted} of them with parameters; "
                                   f"split {plan.pipeline_stages} ways by plan.pp_partition={plan.pp_partition}, "
                                   "stage(s) "
                                   f"{', '.join(map(str, empty))} would get no parameters to train.",
                                   f"set plan.pp to at most {weighted}, or use more layers (model.n_layer)")])


@contextlib.contextmanager
def live_cluster(cfg: RunConfig, *, connect: bool = False) -> Iterator[tuple[ClusterSpec, list[str]]]:
    """The cluster to plan for: read off the live Ray cluster when there is an address.

    Yields the cluster and notes on which declared numbers the live facts replaced; raises
    PlanError when the live cluster cannot host the declared workers. The connection stays open
    until the block ends, so the command's own ``ray_session`` inside it reuses the connection
    instead of opening a second one (a ``ray://`` client session takes seconds to start).
    ``connect`` joins the cluster even with discover off: a command that will use it learns
    that it is unreachable before it tracks anything.
    """
    if cfg.cluster.address is None or not (cfg.cluster.discover or connect):
        yield cfg.cluster, declared_memory_notes(cfg.cluster)
        return
    from orch.launchers.discovery import discover_nodes
    from orch.launchers.ray_session import ray_session

    # Before connecting, the values the connection itself uses; the data is opened once, later,
    # with the workload (a user's Dataset may be costly to open).
    if declared := declared_violations(cfg):
        raise PlanError(declared)
    with ray_session(cfg.cluster.address, connect_timeout_s=cfg.cluster.connect_timeout_s):
        if not cfg.cluster.discover:
            yield cfg.cluster, []
            return
        nodes = discover_nodes(timeout_s=cfg.cluster.wait_s)
        cluster, violations, notes = reconcile(cfg.cluster, nodes)
        if violations:
            raise PlanError(violations)
        yield cluster, notes


def declared_memory_notes(cluster: ClusterSpec) -> list[str]:
    """A GPU cluster planned with the schema's CPU share of host memory (``cluster.accelerator=gpu``
    over the CPU preset, no ``device_memory_gib`` given) would be judged against 8 GiB devices
    without a word; it is said, with the fix."""
    default = ClusterSpec().device_memory_gib
    if cluster.accelerator == Accelerator.gpu and cluster.device_memory_gib == default:
        return [f"cluster.device_memory_gib={default:g} is the CPU preset's share of host memory per worker, not a "
                "GPU's: the plan is judged against it. Set the GPU's memory (cluster.device_memory_gib=80), or choose "
                "a GPU cluster (cluster=a100_8x)"]
    return []


def check_run(cfg: RunConfig, model_cfg: dict, cluster: ClusterSpec | None = None) -> tuple[PlanEstimate, ModelFacts]:
    """:func:`checked_run`'s estimate and model facts."""
    return checked_run(cfg, model_cfg, cluster)[:2]


def resolve_inputs(cfg: RunConfig, model_cfg: dict, cluster: ClusterSpec,
                   workload: Workload | None = None) -> tuple[Workload, ResolvedPlan]:
    """The workload and the validated plan, or one PlanError with every problem the config shows
    before the model is built (milliseconds: `orch train` starts Ray only after this)."""
    problems: list[Violation] = []
    if workload is None:
        try:
            workload = resolve_workload(model_cfg, cfg.objective, cfg.data)
        except PlanError as error:
            problems += error.violations
    try:
        plan = validated_plan(cfg, cluster, workload.data if workload else None)
    except PlanError as error:
        problems += error.violations
    if problems:
        raise PlanError(problems)
    return workload, plan


def checked_run(cfg: RunConfig, model_cfg: dict, cluster: ClusterSpec | None = None,
                workload: Workload | None = None, plan: ResolvedPlan | None = None,
                ) -> tuple[PlanEstimate, ModelFacts, ModelProbe, Workload]:
    """Resolve the plan and the workload and check the model (raising PlanError on bad input), then
    estimate memory.

    ``cluster`` is what :func:`live_cluster` found; the declared ``cfg.cluster`` by default. A
    caller that ran :func:`resolve_inputs` passes its workload and plan. The workload and the
    model probe are returned for the caller to reuse: the model is built on ``meta`` once per
    command.
    """
    cluster = cluster or cfg.cluster
    if workload is None or plan is None:
        workload, plan = resolve_inputs(cfg, model_cfg, cluster, workload)
    constructor_cfg = workload.model_config
    # The model's contract, before any arithmetic on it; a deep one is built at shallow depths only.
    facts, shallow = inspect_declared_model(constructor_cfg, workload, cluster, plan.precision, plan.offload_param,
                                           factory=workload.model_factory)
    check_model(facts, cfg, workload)
    probe = ModelProbe(workload.model_factory, workload, tp_layer_specs=workload.tp_layer_specs,
                       pipeline_layers=workload.pipeline_layers, shallow=shallow,
                       weight_file_bytes=workload.weight_file_bytes)
    if plan.tp > 1:
        check_tensor_parallel(probe, plan, workload)
    if plan.pp > 1:
        check_pipeline(probe, plan, constructor_cfg, workload.pipeline_refusal)
    if plan.cp > 1:
        check_context_parallel(probe, plan, workload.model_config.get("_target_", "the model"))

    return check_plan(plan, cluster, cfg.optim, probe), facts, probe, workload


# The top-level keys of `orch check --json`; tools read these names, so they only ever grow.
# ``per_device`` and every entry of ``stages`` hold orch.plans.memory.estimate.DEVICE_JSON_KEYS.
CHECK_JSON_KEYS = ("feasible", "world_size", "plan", "model", "per_device", "per_node_host", "stages",
                   "pipeline", "phases", "violations", "suggestions", "attention", "fsdp", "cluster", "placement",
                   "predicted_step", "output_head")
CLUSTER_JSON_KEYS = ("source", "notes", "nodes", "devices_per_node", "device_memory_gib", "host_memory_gib")


def check_document(estimate: PlanEstimate, cluster: ClusterSpec, notes: list[str], step: StepTime) -> dict:
    """The `orch check --json` document: the estimate (:meth:`PlanEstimate.as_json`), the cluster
    it was planned for (``source``: live or declared), the rank placement and the predicted step
    (:func:`orch.plans.step_time.prediction.declared_plan_step`: ``StepTime.as_dict``, where its speeds come from
    and ``range_s``, its P10-P90 from the cost model's measured error: :class:`~orch.plans.step_time.ranges.StepRange`).

    Every value is a plain JSON type (``json.dumps`` needs no ``default=``)."""
    doc = estimate.as_json()
    doc["cluster"] = {"source": "live" if cluster.address and cluster.discover else "declared",
                      "notes": list(notes), "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
                      "device_memory_gib": cluster.device_memory_gib, "host_memory_gib": cluster.host_memory_gib}
    plan = estimate.plan
    doc["placement"] = rank_layout(plan.world_size, cluster.devices_per_node, plan.tp, plan.pp, plan.cp)
    doc["predicted_step"] = {**step.as_dict(), "speeds": cluster_speeds(cluster, plan.precision)[1],
                             "assumes": step_assumptions(plan, cluster),
                             "range_s": declared_step_range(step, plan, cluster).as_json()}
    # How the tensor-parallel ranks hold the output head ("" without tp or a head that splits).
    doc["output_head"] = estimate.output_head
    return doc


def step_assumptions(plan: ResolvedPlan, cluster: ClusterSpec) -> list[str]:
    """What the predicted step assumes of the plan's schedule and kernels, beyond its degrees: the
    pipeline schedule's bubble, compiled blocks, async TP's overlap, FP8 matmuls and attention's
    measured rate (docs/tuner.md)."""
    found = []
    share = cluster_speeds(cluster, plan.precision)[0].attention_share
    if share != 1.0:
        found.append(f"attention at {share:.2g} of the matmul rate (the cluster profile's measurement)")
    if plan.pp > 1:
        virtual = f" with {plan.pp_virtual_stages} stages per rank" if plan.pp_virtual_stages > 1 else ""
        found.append(f"the {plan.pp_schedule.value} schedule{virtual}")
    if plan.compile:
        found.append("each block compiled (its memory-bound kernels fused as inductor fuses them)")
    if plan.async_tp:
        found.append("async TP (the tensor-parallel collectives overlapped with their matmuls, run in "
                     f"{plan.tp} chunks)")
    if plan.precision == Precision.fp8:
        found.append(f"FP8 matmuls in the blocks' linear layers ({plan.fp8_recipe.value} scaling) at "
                     f"{fp8_speedup(cluster):.2g}x the bf16 rate, their casts included")
    return found


def _step_lines(step: StepTime, plan: ResolvedPlan, cluster: ClusterSpec) -> list[str]:
    """The declared plan's predicted step: its time and range, its parts, and the speeds it assumes."""
    parts = ", ".join(f"{name} {seconds:.3g}" for name, seconds in step.as_dict()["parts_s"].items() if seconds > 0)
    spread = declared_step_range(step, plan, cluster)
    between = f", P10-P90 {spread.p10:.3g}-{spread.p90:.3g} s" if spread.known else ""
    return [f"step time  {step.total_s:.3g} s predicted{between} ({parts} s), "
            f"{plan.global_batch_size / step.total_s:,.1f} samples/s",
            f"  {'range: ' if spread.known else ''}{spread.source}",
            f"  at speeds {cluster_speeds(cluster, plan.precision)[1]}"
            + ("" if cluster.measured else "; `orch calibrate` measures the cluster's own speeds on its workers"),
            *([f"  assuming {'; '.join(assumed)}"] if (assumed := step_assumptions(plan, cluster)) else [])]


def _fmt(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:10.2f} GiB"
    return f"{n / 1024**2:10.1f} MiB"


def _placement_lines(layout: list[dict[str, int]], max_nodes: int = 8) -> list[str]:
    """One line per node: its ranks and their (dp, pp, tp) coordinates, (dp, pp, cp, tp) where the
    sequence is split."""
    by_node: dict[int, list[dict[str, int]]] = {}
    for slot in layout:
        by_node.setdefault(slot["node"], []).append(slot)
    axes = ("dp", "pp", "cp", "tp") if layout and "cp_rank" in layout[0] else ("dp", "pp", "tp")
    lines = [f"placement (rank: {','.join(axes)})"]
    for node, slots in list(by_node.items())[:max_nodes]:
        lines.append(f"  node {node}: " + " ".join(f"{s['rank']}:" + ",".join(str(s[f"{a}_rank"]) for a in axes)
                                                   for s in slots))
    if len(by_node) > max_nodes:
        lines.append(f"  ... {len(by_node) - max_nodes} more nodes laid out the same way")
    return lines


def _layer_names(names: tuple[str, ...]) -> str:
    """``Embedding, Block x 2, LayerNorm``: runs of one layer class collapsed."""
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if count == 1 else f"{name} x {count}" for name, count in runs)


# Below this many threads an offloaded optimizer of a GPU worker is worth a note: a GPU node's
# CPUs are mostly idle otherwise (8 GPUs beside 64-128 cores), and the step waits on them.
FEW_HOST_THREADS = 4


def _host_optimizer_lines(cluster: ClusterSpec) -> list[str]:
    """How many threads the offloaded optimizer steps on, and the fix when that is few per GPU."""
    threads = host_threads(cluster)
    lines = [f"  {'CPU optimizer':<20}{threads} thread{'s' if threads > 1 else ''} per worker "
             f"(cluster.cpus_per_worker={cluster.cpus_per_worker:g}; Ray sets OMP_NUM_THREADS to it)"]
    if cluster.accelerator == Accelerator.gpu and threads < FEW_HOST_THREADS:
        lines.append(f"  {'':<20}about {DECLARED_CPU_ADAM_PARAMS_PER_THREAD_S / 1e9:.1f}B Adam parameters a second "
                     "per thread: give it the node's spare cores, e.g. cluster.cpus_per_worker=8")
    return lines


def render(estimate: PlanEstimate, cluster: ClusterSpec, notes: list[str] = (), step: StepTime | None = None) -> str:
    """The human-readable report: breakdown, host side, the predicted step time, verdict and fixes."""
    p, d, h, m = estimate.plan, estimate.per_device, estimate.per_node_host, estimate.model
    spec = engine_spec(p.engine)
    lines = [
        f"plan     {p.layout_text()} (global batch {p.global_batch_size})",
        f"cluster  {cluster.nodes} node(s) x {cluster.devices_per_node} {p.accelerator.value} device(s) "
        f"of {cluster.device_memory_gib:g} GiB, {cluster.host_memory_gib:g} GiB host memory per node"
        + (" (read off the live cluster)" if cluster.address and cluster.discover else " (declared)"),
        *[f"         {note}" for note in notes],
        f"model    {m.param_count:,} parameters ({m.trainable_count:,} trainable), "
        f"largest layer {m.largest_layer_params:,}",
        *([f"attention {estimate.attention}"] if estimate.attention else []),
        *([f"head     {estimate.output_head}"] if estimate.output_head else []),
        "",
        f"per device (most loaded), at its peak in the {d.phase} phase",
    ]
    rows = [("parameters", d.params), ("gradients", d.grads), ("optimizer states", d.optimizer_states),
            ("activations", d.activations), (spec.buffers_label, d.buffers),
            ("allocator reserve", d.reserve)]
    lines += [f"  {name:<20}{_fmt(value)}" for name, value in rows]
    lines += [f"  {'total':<20}{_fmt(d.total)}", f"  {'  held between steps':<20}{_fmt(d.held)}",
              f"  {'capacity':<20}{_fmt(d.capacity)}",
              f"  {'headroom':<20}{_fmt(d.headroom) if d.headroom >= 0 else '-' + _fmt(-d.headroom).strip():>14}"]
    if estimate.engine_detail is not None:
        lines += estimate.engine_detail.report_lines(d.phase, _fmt)
    if estimate.pipeline:
        schedule = p.pp_schedule.value + (f", {p.pp_virtual_stages} stages per rank" if p.pp_virtual_stages > 1
                                          else "")
        per_rank = len(estimate.pipeline) < p.pipeline_stages  # several stages per rank: one row per rank
        lines += ["", f"pipeline {'ranks' if per_rank else 'stages'} ({p.pp_partition} partition; {schedule} "
                      f"schedule; {p.grad_accum_steps} micro-batches per step)"]
        for stage, memory in zip(estimate.pipeline, estimate.stages, strict=True):
            names = _layer_names(stage.layers)
            lines.append(f"  {'rank' if per_rank else 'stage'} {stage.index}: layers {stage.start}-{stage.stop - 1} "
                         f"({names}), "
                         f"{stage.params:,} params, {stage.in_flight:g} micro-batch(es) in flight, "
                         f"peak {_fmt(memory.total).strip()}")
        bubble = estimate.bubble
        lines.append(f"  bubble {'(pp-1)' if schedule == '1f1b' else '(' + schedule + ' schedule)'}/micro-batches = "
                     f"{bubble:.0%} of the compute time idle"
                     + (f"; raise plan.grad_accum_steps (>= {4 * p.pp} keeps it under 25%)" if bubble > 0.25 else ""))
    lines += ["", "host memory per node",
              f"  {'offloaded states':<20}{_fmt(h.offloaded)}"]
    if h.device_share:
        lines.append(f"  {'CPU workers':<20}{_fmt(h.device_share)}")
    lines += [f"  {'total':<20}{_fmt(h.total)}", f"  {'capacity':<20}{_fmt(h.capacity)}"]
    if h.nvme:
        lines.append(f"  {'on NVMe':<20}{_fmt(h.nvme)}  (plan.nvme_path={p.nvme_path})")
    if p.offload_optimizer != Offload.none:
        lines += _host_optimizer_lines(cluster)
    if (b := estimate.build) is not None:
        builders = f"{b.workers} worker(s) x {b.how}" if b.builders is None else \
            f"{b.builders} of {b.workers} worker(s) x {b.how}, the others on meta"
        lines.append(f"  {'building the model':<20}{_fmt(b.total)}  ({builders}"
                     + (f" + {_fmt(b.weights).strip()} of weight files" if b.weights else "") + ")")
    lines.append("")
    lines += _placement_lines(rank_layout(p.world_size, cluster.devices_per_node, p.tp, p.pp, p.cp)) + [""]
    if step is not None:
        lines += _step_lines(step, p, cluster) + [""]
    if estimate.feasible:
        lines.append(f"verdict  FITS with {p.engine}: {_fmt(d.total).strip()} of {_fmt(d.capacity).strip()} "
                     "per device")
    else:
        lines.append(f"verdict  DOES NOT FIT with {p.engine}")
        lines += [f"  - {v.field}: {v.message}" for v in estimate.violations]
        if estimate.suggestions:
            lines.append("  smallest changes that fit:")
            lines += [f"    * {s}" for s in estimate.suggestions]
        else:
            lines.append("  no single or paired plan change fits: use more or larger devices")
    return "\n".join(lines)
