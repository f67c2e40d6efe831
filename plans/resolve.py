"""Validate a declared plan against the cluster and the model, and resolve it.

All problems are collected and raised together in one :class:`PlanError`; nothing here
touches Ray, DeepSpeed or a device, so every rule is testable in milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plans.errors import PlanError, Violation
from plans.spec import Accelerator, ClusterSpec, EngineName, FSDPSpec, Offload, PlanSpec, Precision, TrainSpec

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

    def as_dict(self) -> dict[str, object]:
        """Plain values (enums as strings), for tracking and JSON output."""
        out = {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(self).items()}
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

    if plan.zero_stage not in (0, 1, 2, 3):
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
                           f"{', '.join(str(d) for d in _divisors(cluster.devices_per_node))}"))
    if plan.tp > 1 and plan.zero_stage in (0, 1, 2, 3) and plan.zero_stage not in TP_ZERO_STAGES:
        v.append(Violation("plan.zero_stage", plan.zero_stage,
                           f"DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO stages "
                           f"{', '.join(map(str, TP_ZERO_STAGES))} only, not stage {plan.zero_stage} "
                           f"(plan.tp={plan.tp}).",
                           f"set plan.zero_stage={max(TP_ZERO_STAGES)}, or plan.tp=1 to keep ZeRO-{plan.zero_stage}"))
    if plan.pp > 1 and plan.zero_stage in (2, 3):
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
        precision=plan.precision, accelerator=cluster.accelerator, engine=plan.engine, fsdp=plan.fsdp,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_fix(global_batch: int, micro: int, dp: int) -> str:
    per_micro_step = micro * dp
    if global_batch % per_micro_step == 0:
        return f"set plan.grad_accum_steps={global_batch // per_micro_step}"
    return (f"choose plan.micro_batch_size and plan.grad_accum_steps whose product times dp({dp}) "
            f"is {global_batch}, or change train.global_batch_size")
