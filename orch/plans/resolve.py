"""Validate a declared plan against the cluster and the model, and resolve it.

All problems are collected and raised together in one :class:`PlanError`; nothing here
touches Ray, DeepSpeed or a device, so every rule is testable in milliseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orch.plans.engines import engine_names, engine_spec
from orch.plans.errors import PlanError, Violation
from orch.plans.parallel.schedules import schedule_of, schedule_violations
from orch.plans.spec import (
    Accelerator,
    ClusterSpec,
    Fp8Recipe,
    FSDPSpec,
    Offload,
    PipelineSchedule,
    PlanSpec,
    Precision,
    Recompute,
    TrainSpec,
)


@dataclass(frozen=True, kw_only=True)
class ResolvedPlan:
    """A plan with every degree fixed and checked against the cluster; safe to launch."""

    dp: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    """Ranks each sample's sequence is split over; they read the same samples, as tp ranks do."""
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    nvme_path: str | None
    activation_checkpointing: Recompute
    """What backward recomputes (true/false given here are taken as full/none)."""
    recompute_every_n_layers: int = 1
    """Checkpoint every n-th repeated block only (1: all of them)."""
    pp_partition: str = "parameters"
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """How micro-batches move through the stages (read only when pp > 1)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank: the model is cut into pp * pp_virtual_stages stages."""
    micro_batch_size: int
    grad_accum_steps: int
    precision: Precision
    accelerator: Accelerator
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """How FP8 matmuls scale their operands (read only with precision fp8)."""
    engine: str = "deepspeed"
    """The engine's name (:func:`orch.plans.engines.engine_spec` answers for it)."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    compile: bool = False
    """torch.compile each repeated block."""
    sequence_parallel: bool = False
    """Split the residual stream along the sequence over the tensor-parallel ranks."""
    async_tp: bool = False
    """Overlap the sequence-parallel collectives with their matmuls (compiled, on GPUs)."""
    loss_parallel: bool = True
    """Split the output head over the vocabulary where the engine and model can
    (:func:`orch.plans.parallel.vocab_parallel.splits_head`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", Recompute.of(self.activation_checkpointing))
        object.__setattr__(self, "pp_schedule", PipelineSchedule(self.pp_schedule))
        object.__setattr__(self, "fp8_recipe", Fp8Recipe(self.fp8_recipe))

    @property
    def pipeline_stages(self) -> int:
        """Stages the model is cut into: ``pp * pp_virtual_stages`` (1 without a pipeline)."""
        return self.pp * self.pp_virtual_stages if self.pp > 1 else 1

    def recomputed_share(self, blocks: int) -> float:
        """The share of the busiest pipeline rank's repeated blocks whose forward backward runs
        again: 0 without activation checkpointing, 1 with every block checkpointed; with
        ``recompute_every_n_layers`` = n, blocks 0, n, 2n, ... of the ``ceil(blocks / pp)`` a rank
        holds, as the engines wrap them (all of them for a model without repeated blocks)."""
        if not self.activation_checkpointing:
            return 0.0
        held = -(-blocks // max(self.pp, 1))
        if held <= 0 or self.recompute_every_n_layers <= 1:
            return 1.0
        return -(-held // self.recompute_every_n_layers) / held

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp

    def engine_settings(self) -> dict[str, object]:
        """The engine's own settings in this plan, by override key under ``plan.`` (``zero_stage``;
        ``fsdp.reshard_after_forward``, ``fsdp.hybrid``)."""
        spec = engine_spec(self.engine)
        return {key: spec.setting(self, key) for key in spec.tracked_settings}

    def engine_text(self) -> str:
        """How the data-parallel ranks share the model, as overrides would say it:
        ``engine=deepspeed zero_stage=2``, or ``engine=fsdp2 fsdp.reshard_after_forward=true fsdp.hybrid=false``."""
        return " ".join([f"engine={self.engine}", *(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                    for k, v in self.engine_settings().items())])

    def layout_text(self) -> str:
        """The plan in one line, as its overrides would say it (`orch check` and `orch train` print it)."""
        schedule = ""
        if self.pp > 1 and (self.pp_schedule != PipelineSchedule.one_f_one_b or self.pp_virtual_stages != 1):
            schedule = f"pp_schedule={self.pp_schedule.value} pp_virtual_stages={self.pp_virtual_stages} "
        context = f"cp={self.cp} " if self.cp > 1 else ""
        every = (f"recompute_every_n_layers={self.recompute_every_n_layers} "
                 if self.activation_checkpointing and self.recompute_every_n_layers > 1 else "")
        return (f"{self.engine_text()} dp={self.dp} tp={self.tp} pp={self.pp} {context}{schedule}"
                f"offload_optimizer={self.offload_optimizer.value} offload_param={self.offload_param.value} "
                f"activation_checkpointing={self.activation_checkpointing.value} {every}"
                f"precision={self.precision.value} "
                + (f"fp8_recipe={self.fp8_recipe.value} " if self.precision == Precision.fp8 else "")
                + f"micro_batch_size={self.micro_batch_size} "
                f"grad_accum_steps={self.grad_accum_steps}" + (" compile=true" if self.compile else "")
                + (" sequence_parallel=true" if self.sequence_parallel else "")
                + (" async_tp=true" if self.async_tp else "")
                + (" loss_parallel=false" if not self.loss_parallel else ""))

    def as_dict(self) -> dict[str, object]:
        """Plain values (enums as strings), for tracking and JSON output, flat: an engine's nested
        settings are named as its overrides name them (``fsdp.hybrid``) and only under the engine
        that reads them (a DeepSpeed plan has no ``fsdp.*``)."""
        out: dict[str, object] = {}
        nested = {key: value for key, value in self.engine_settings().items() if "." in key}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "fsdp":
                out.update(nested)
                continue
            out[f.name] = value.value if hasattr(value, "value") else value
        out["global_batch_size"] = self.global_batch_size
        return out


def _check_positive(field: str, value: int, violations: list[Violation]) -> None:
    if value < 1:
        violations.append(Violation(field, value, "must be at least 1.", f"set {field}=1 or more"))


def _check_profile_steps(train: TrainSpec, violations: list[Violation]) -> None:
    """Profiled steps must be steps of the run, and not the memory-probe step, whose tensor tracker
    would slow the step the profiler times."""
    steps = list(train.profile_steps)
    if outside := [step for step in steps if not 1 <= step <= train.steps]:
        violations.append(Violation("train.profile_steps", steps,
                                    f"step(s) {outside} are not among the run's steps 1..{train.steps} "
                                    f"(train.steps={train.steps}).",
                                    f"name steps from 1 to {train.steps}, e.g. train.profile_steps=[{train.steps}]"))
    if train.memory_probe_detail and not train.memory_probe_step:
        violations.append(Violation("train.memory_probe_detail", True, "says what was alive at the memory probe's "
                                    "peak, and train.memory_probe_step=0 turns the probe off.",
                                    "set train.memory_probe_step to a step of the run (2 by default)"))
    if train.memory_probe_step and train.memory_probe_step in steps:
        other = next((s for s in range(train.steps, 0, -1) if s != train.memory_probe_step), 1)
        violations.append(Violation("train.profile_steps", steps,
                                    f"step {train.memory_probe_step} is train.memory_probe_step, whose memory "
                                    "tracker slows the step the profiler would record.",
                                    f"profile another step (e.g. train.profile_steps=[{other}]), or move "
                                    "train.memory_probe_step"))


def resolve_plan(plan: PlanSpec, cluster: ClusterSpec, train: TrainSpec) -> ResolvedPlan:
    """Return the resolved plan, or raise :class:`PlanError` listing every problem."""
    v: list[Violation] = []
    world = cluster.world_size
    for name in ("nodes", "devices_per_node"):
        _check_positive(f"cluster.{name}", getattr(cluster, name), v)
    for name in ("tp", "pp", "cp", "micro_batch_size", "grad_accum_steps"):
        _check_positive(f"plan.{name}", getattr(plan, name), v)
    _check_positive("train.steps", train.steps, v)
    _check_positive("train.log_every", train.log_every, v)
    _check_profile_steps(train, v)

    tp_fits_node = plan.tp < 1 or cluster.devices_per_node < 1 or cluster.devices_per_node % plan.tp == 0
    if not tp_fits_node:
        # Tensor-parallel ranks all-reduce in every layer, forward and backward: only the links
        # inside a node are fast enough, so a TP group never spans nodes.
        v.append(Violation("plan.tp", plan.tp,
                           f"a tensor-parallel group must sit inside one node, but tp({plan.tp}) does not divide "
                           f"cluster.devices_per_node({cluster.devices_per_node}) "
                           f"({cluster.devices_per_node} % {plan.tp} = {cluster.devices_per_node % plan.tp}).",
                           f"set plan.tp to a divisor of {cluster.devices_per_node}: "
                           f"{', '.join(str(d) for d in divisors(cluster.devices_per_node))}"))

    model_parallel = max(plan.tp, 1) * max(plan.pp, 1) * max(plan.cp, 1)
    product = f"tp({plan.tp}) * pp({plan.pp})" + (f" * cp({plan.cp})" if plan.cp != 1 else "")
    dp = plan.dp
    if dp is None:
        if world >= 1 and world % model_parallel and tp_fits_node:
            v.append(Violation("plan.cp" if plan.cp != 1 else "plan.tp", plan.cp if plan.cp != 1 else plan.tp,
                               f"{product} = {model_parallel} does not divide "
                               f"the world size {world} (cluster.nodes={cluster.nodes} * "
                               f"cluster.devices_per_node={cluster.devices_per_node}).",
                               "choose tp, pp" + (" and cp" if plan.cp != 1 else "") +
                               " whose product divides the world size"))
        dp = max(world // model_parallel, 1)
    elif dp < 1:
        v.append(Violation("plan.dp", dp, "must be at least 1.", "set plan.dp=1 or more, or null to fill the cluster"))
    elif dp * model_parallel != world:
        v.append(Violation("plan.dp", dp,
                           f"dp({dp}) * {product} = {dp * model_parallel} != world size "
                           f"{world} (cluster.nodes={cluster.nodes} * cluster.devices_per_node="
                           f"{cluster.devices_per_node}).",
                           f"set plan.dp={max(world // model_parallel, 1)} (or null), or change "
                           f"cluster.devices_per_node / cluster.nodes to give {dp * model_parallel} workers"))

    try:
        recompute = Recompute.of(plan.activation_checkpointing)
    except ValueError:
        recompute = Recompute.none
        v.append(Violation("plan.activation_checkpointing", plan.activation_checkpointing,
                           "is not a recomputation policy.",
                           "set plan.activation_checkpointing to none, selective or full (true and false "
                           "mean full and none)"))

    every = plan.recompute_every_n_layers
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        v.append(Violation("plan.recompute_every_n_layers", every, "must be a whole number >= 1.",
                           "set plan.recompute_every_n_layers=1 (every block), or n > 1 for every n-th"))
    elif every > 1 and not recompute:
        v.append(Violation("plan.recompute_every_n_layers", every,
                           "chooses which blocks activation checkpointing recomputes, and "
                           "plan.activation_checkpointing=none recomputes none.",
                           "set plan.activation_checkpointing=full (or selective), or "
                           "plan.recompute_every_n_layers=1"))

    recipe = Fp8Recipe(plan.fp8_recipe)  # the config's enum type refused any other value
    if recipe != Fp8Recipe.tensorwise and Precision(plan.precision) != Precision.fp8:
        v.append(Violation("plan.fp8_recipe", recipe.value,
                           f"scales FP8 matmuls, and plan.precision={Precision(plan.precision).value} runs none.",
                           "set plan.precision=fp8, or leave plan.fp8_recipe at tensorwise"))

    v += schedule_violations(plan.pp_schedule, pp=plan.pp, virtual=plan.pp_virtual_stages,
                             micro_batches=plan.grad_accum_steps)

    # The engine's own rules, after the layout's: its fixes may assume the degrees are sound.
    if plan.engine not in engine_names():
        v.append(Violation("plan.engine", plan.engine, "is not an engine orch has.",
                           f"set plan.engine to one of {', '.join(engine_names())}"))
    else:
        v += engine_spec(plan.engine).violations(plan, cluster)

    if train.global_batch_size is not None and dp >= 1 and plan.micro_batch_size >= 1 and plan.grad_accum_steps >= 1:
        per_step = plan.micro_batch_size * plan.grad_accum_steps * dp
        if train.global_batch_size != per_step:
            v.append(Violation("train.global_batch_size", train.global_batch_size,
                               f"micro_batch_size({plan.micro_batch_size}) * grad_accum_steps("
                               f"{plan.grad_accum_steps}) * dp({dp}) = {per_step}.",
                               _batch_fix(train.global_batch_size, plan.micro_batch_size, dp)))

    if v:
        raise PlanError(v)
    return ResolvedPlan(
        dp=dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, world_size=world, zero_stage=plan.zero_stage,
        offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param,
        nvme_path=plan.nvme_path, activation_checkpointing=recompute,
        recompute_every_n_layers=every if recompute else 1,
        pp_partition=plan.pp_partition, pp_schedule=schedule_of(plan.pp_schedule),
        pp_virtual_stages=plan.pp_virtual_stages, micro_batch_size=plan.micro_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        precision=plan.precision, accelerator=cluster.accelerator, engine=plan.engine, fp8_recipe=recipe,
        fsdp=dataclasses.replace(plan.fsdp), compile=plan.compile, sequence_parallel=plan.sequence_parallel,
        async_tp=plan.async_tp, loss_parallel=plan.loss_parallel,
    )


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the degrees a count of devices splits into evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_fix(global_batch: int, micro: int, dp: int) -> str:
    per_micro_step = micro * dp
    if global_batch % per_micro_step == 0:
        return f"set plan.grad_accum_steps={global_batch // per_micro_step}"
    return (f"choose plan.micro_batch_size and plan.grad_accum_steps whose product times dp({dp}) "
            f"is {global_batch}, or change train.global_batch_size")
