"""Validate a declared plan against the cluster and the model, and resolve it.

All problems are collected and raised together in one :class:`PlanError`; nothing here
touches Ray, DeepSpeed or a device, so every rule is testable in milliseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orch.plans.errors import PlanError, Violation
from orch.plans.spec import Accelerator, ClusterSpec, EngineName, FSDPSpec, Offload, PlanSpec, Precision, TrainSpec

# ZeRO stages DeepSpeed's pipeline engine trains with: it asserts stage < 2
# (deepspeed/runtime/pipe/engine.py, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism").
PP_ZERO_STAGES = (0, 1)
# DeepSpeed PipelineModule's partition methods ("profile" is declared there but not implemented).
PP_PARTITIONS = ("parameters", "uniform")
# ZeRO stages DeepSpeed's AutoTP is documented to *train* with: its tutorial
# (docs/_tutorials/autotp-training.md) lists 0, 1 and 2, and its grad-norm parity tests
# (tests/unit/model_parallelism/test_autotp_training.py) cover those three. ZeRO-3 is only tested
# to initialise there, although the 0.19 engine says it trains (and a dp=2 x tp=2 run here matched
# dp=2); add 3 once a parity test in tests/test_tensor_parallel.py covers it.
TP_ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True, kw_only=True)
class ResolvedPlan:
    """A plan with every degree fixed and checked against the cluster; safe to launch."""

    dp: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    nvme_path: str | None
    activation_checkpointing: bool
    pp_partition: str = "parameters"
    micro_batch_size: int
    grad_accum_steps: int
    precision: Precision
    accelerator: Accelerator
    engine: EngineName = EngineName.deepspeed
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp

    def engine_text(self) -> str:
        """How the data-parallel ranks share the model, as overrides would say it:
        ``engine=deepspeed zero_stage=2``, or ``engine=fsdp2 fsdp.reshard_after_forward=true fsdp.hybrid=false``."""
        if self.engine == EngineName.fsdp2:
            return f"engine={self.engine.value} " + " ".join(
                f"fsdp.{k}={str(v).lower()}" for k, v in dataclasses.asdict(self.fsdp).items())
        return f"engine={self.engine.value} zero_stage={self.zero_stage}"

    def layout_text(self) -> str:
        """The plan in one line, as its overrides would say it (`orch check` and `orch train` print it)."""
        return (f"{self.engine_text()} dp={self.dp} tp={self.tp} pp={self.pp} "
                f"offload_optimizer={self.offload_optimizer.value} offload_param={self.offload_param.value} "
                f"activation_checkpointing={str(self.activation_checkpointing).lower()} "
                f"precision={self.precision.value} micro_batch_size={self.micro_batch_size} "
                f"grad_accum_steps={self.grad_accum_steps}")

    def as_dict(self) -> dict[str, object]:
        """Plain values (enums as strings), for tracking and JSON output, flat: an FSDP2 plan's
        settings are ``fsdp.reshard_after_forward`` and ``fsdp.hybrid``, the names its overrides
        use (``plan.fsdp.hybrid=true``); a DeepSpeed plan has none, since its engine reads none."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "fsdp":
                if self.engine == EngineName.fsdp2:
                    out.update({f"fsdp.{k}": v for k, v in dataclasses.asdict(value).items()})
                continue
            out[f.name] = value.value if hasattr(value, "value") else value
        out["global_batch_size"] = self.global_batch_size
        return out


def _check_positive(field: str, value: int, violations: list[Violation]) -> None:
    if value < 1:
        violations.append(Violation(field, value, "must be at least 1.", f"set {field}=1 or more"))


def resolve_plan(plan: PlanSpec, cluster: ClusterSpec, train: TrainSpec) -> ResolvedPlan:
    """Return the resolved plan, or raise :class:`PlanError` listing every problem."""
    v: list[Violation] = []
    world = cluster.world_size
    for name in ("nodes", "devices_per_node"):
        _check_positive(f"cluster.{name}", getattr(cluster, name), v)
    for name in ("tp", "pp", "micro_batch_size", "grad_accum_steps"):
        _check_positive(f"plan.{name}", getattr(plan, name), v)
    _check_positive("train.steps", train.steps, v)
    _check_positive("train.log_every", train.log_every, v)

    fsdp2 = plan.engine == EngineName.fsdp2
    if fsdp2:
        v += _fsdp2_violations(plan, cluster)
    else:
        v += _ignored_fsdp_settings(plan)
    if plan.zero_stage not in (0, 1, 2, 3) and not fsdp2:
        v.append(Violation("plan.zero_stage", plan.zero_stage, "ZeRO stages are 0, 1, 2 and 3.",
                           "set plan.zero_stage to 0, 1, 2 or 3"))
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
    if not fsdp2 and plan.tp > 1 and plan.zero_stage in (0, 1, 2, 3) and plan.zero_stage not in TP_ZERO_STAGES:
        v.append(Violation("plan.zero_stage", plan.zero_stage,
                           f"DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO stages "
                           f"{', '.join(map(str, TP_ZERO_STAGES))} only, not stage {plan.zero_stage} "
                           f"(plan.tp={plan.tp}).",
                           f"set plan.zero_stage={max(TP_ZERO_STAGES)}, or plan.tp=1 to keep ZeRO-{plan.zero_stage}"))
    if not fsdp2 and plan.pp > 1 and plan.zero_stage in (2, 3):
        v.append(Violation("plan.zero_stage", plan.zero_stage,
                           f"DeepSpeed's pipeline engine trains with ZeRO stages "
                           f"{', '.join(map(str, PP_ZERO_STAGES))} only, not stage {plan.zero_stage} "
                           f"(plan.pp={plan.pp}): it partitions gradients itself, stage by stage.",
                           f"set plan.zero_stage={max(PP_ZERO_STAGES)}, or plan.pp=1 to keep ZeRO-{plan.zero_stage}"))
    if plan.pp_partition not in PP_PARTITIONS and not (plan.pp_partition.startswith("type:")
                                                        and len(plan.pp_partition) > len("type:")):
        v.append(Violation("plan.pp_partition", plan.pp_partition,
                           "is not a partition method of DeepSpeed's PipelineModule.",
                           "set plan.pp_partition to parameters, uniform or type:REGEX (e.g. type:Block)"))

    model_parallel = max(plan.tp, 1) * max(plan.pp, 1)
    dp = plan.dp
    if dp is None:
        if world >= 1 and world % model_parallel and tp_fits_node:
            v.append(Violation("plan.tp", plan.tp,
                               f"tp({plan.tp}) * pp({plan.pp}) = {model_parallel} does not divide "
                               f"the world size {world} (cluster.nodes={cluster.nodes} * "
                               f"cluster.devices_per_node={cluster.devices_per_node}).",
                               "choose tp and pp whose product divides the world size"))
        dp = max(world // model_parallel, 1)
    elif dp < 1:
        v.append(Violation("plan.dp", dp, "must be at least 1.", "set plan.dp=1 or more, or null to fill the cluster"))
    elif dp * model_parallel != world:
        v.append(Violation("plan.dp", dp,
                           f"dp({dp}) * tp({plan.tp}) * pp({plan.pp}) = {dp * model_parallel} != world size "
                           f"{world} (cluster.nodes={cluster.nodes} * cluster.devices_per_node="
                           f"{cluster.devices_per_node}).",
                           f"set plan.dp={max(world // model_parallel, 1)} (or null), or change "
                           f"cluster.devices_per_node / cluster.nodes to give {dp * model_parallel} workers"))

    if not fsdp2:
        v += _zero_offload_violations(plan, cluster)

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
        dp=dp, tp=plan.tp, pp=plan.pp, world_size=world, zero_stage=plan.zero_stage,
        offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param,
        nvme_path=plan.nvme_path, activation_checkpointing=plan.activation_checkpointing,
        pp_partition=plan.pp_partition, micro_batch_size=plan.micro_batch_size, grad_accum_steps=plan.grad_accum_steps,
        precision=plan.precision, accelerator=cluster.accelerator, engine=plan.engine,
        fsdp=dataclasses.replace(plan.fsdp),
    )


def _schema_default(name: str) -> object:
    """The default of ``PlanSpec.<name>``, as the schema declares it."""
    return next(f.default for f in dataclasses.fields(PlanSpec) if f.name == name)


def _ignored_fsdp_settings(plan: PlanSpec) -> list[Violation]:
    """Each ``plan.fsdp.*`` key set away from its default while DeepSpeed trains, which never reads it."""
    found = []
    for f in dataclasses.fields(FSDPSpec):
        value, default = getattr(plan.fsdp, f.name), f.default
        if value != default:
            found.append(Violation(f"plan.fsdp.{f.name}", value,
                                   f"is an FSDP2 setting, which plan.engine={plan.engine.value} ignores.",
                                   f"set plan.engine=fsdp2 to use it, or leave plan.fsdp.{f.name} at its default "
                                   f"({str(default).lower()})"))
    return found


def _fsdp2_violations(plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
    """What PyTorch FSDP2 (``fully_shard``) cannot train, or orch's FSDP2 engine does not run."""
    found = []
    if plan.pp > 1:
        found.append(Violation("plan.pp", plan.pp,
                               "pipeline plans are DeepSpeed's: the FSDP2 engine trains without pipeline stages.",
                               "set plan.engine=deepspeed or plan.pp=1"))
    default_stage = _schema_default("zero_stage")
    if plan.zero_stage != default_stage:
        found.append(Violation("plan.zero_stage", plan.zero_stage,
                               "FSDP2 always shards parameters, gradients and optimizer states over the "
                               "data-parallel ranks (what ZeRO-3 shards); it has no ZeRO stages to choose.",
                               f"leave plan.zero_stage at its default ({default_stage}) with plan.engine=fsdp2, "
                               "or set plan.engine=deepspeed to choose a stage"))
    offloads = {"plan.offload_optimizer": plan.offload_optimizer, "plan.offload_param": plan.offload_param}
    nvme = [name for name, where in offloads.items() if where == Offload.nvme]
    for name in nvme:
        found.append(Violation(name, Offload.nvme.value,
                               "FSDP2 offloads to host memory only (its CPUOffloadPolicy); it has no NVMe offload.",
                               "set plan.offload_optimizer=cpu and plan.offload_param=cpu, or plan.engine=deepspeed "
                               "for NVMe offload"))
    cpu = [name for name, where in offloads.items() if where == Offload.cpu]
    if not nvme and len(cpu) == 1:
        other = next(name for name in offloads if name not in cpu)
        found.append(Violation(cpu[0], Offload.cpu.value,
                               "FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states to the host "
                               f"together, so it cannot offload one without the other ({other}=none).",
                               f"set {other}=cpu as well, or {cpu[0]}=none"))
    return found


def _zero_offload_violations(plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
    """DeepSpeed's rules for offload (which ZeRO stage moves what where) and for fp16."""
    v: list[Violation] = []
    if plan.offload_param != Offload.none and plan.zero_stage != 3:
        v.append(Violation("plan.offload_param", plan.offload_param.value,
                           f"parameter offload needs ZeRO stage 3 (plan.zero_stage={plan.zero_stage}).",
                           "set plan.zero_stage=3, or plan.offload_param=none"))
    if plan.offload_optimizer != Offload.none and plan.zero_stage == 0:
        v.append(Violation("plan.offload_optimizer", plan.offload_optimizer.value,
                           "optimizer offload needs ZeRO stage 1, 2 or 3 (plan.zero_stage=0).",
                           "set plan.zero_stage=1 or higher, or plan.offload_optimizer=none"))
    if Offload.nvme in (plan.offload_optimizer, plan.offload_param) and not plan.nvme_path:
        v.append(Violation("plan.nvme_path", plan.nvme_path, "NVMe offload needs a directory to write to.",
                           "set plan.nvme_path=/path/on/local/nvme, or offload to cpu"))
    if plan.precision == Precision.fp16 and cluster.accelerator == Accelerator.cpu:
        v.append(Violation("plan.precision", "fp16",
                           "DeepSpeed does not support fp16 training on CPU workers (cluster.accelerator=cpu).",
                           "set plan.precision=bf16 (or fp32) for CPU runs; keep fp16 for GPU clusters"))

    return v


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the degrees a count of devices splits into evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_fix(global_batch: int, micro: int, dp: int) -> str:
    per_micro_step = micro * dp
    if global_batch % per_micro_step == 0:
        return f"set plan.grad_accum_steps={global_batch // per_micro_step}"
    return (f"choose plan.micro_batch_size and plan.grad_accum_steps whose product times dp({dp}) "
            f"is {global_batch}, or change train.global_batch_size")
