"""What the planner asks of a training engine: :class:`EngineSpec`, one instance per engine.

Every layer asks the engine's spec instead of branching on its name: the plan's rules
(:func:`orch.plans.resolve.resolve_plan`), its settings (:mod:`orch.plans.engine_settings`), the
memory of one device and of a node while the model is built (:mod:`orch.plans.memory.estimate`), the fixes
tried when a plan does not fit, the predicted step (:mod:`orch.plans.step_time.prediction`), the tuner's axes
(:mod:`orch.plans.search.space`) and the plan's description in reports. The spec names the
runtime class the workers train with (as Ray Train's ``BackendConfig.backend_cls`` names its
backend), so the launchers find it here too.

A spec module imports no DeepSpeed, ``torch.distributed`` or torch-importing planner module at
module level: a plan is resolved before torch is imported (``orch train`` starts Ray meanwhile),
and a plan for one engine never loads another's library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from orch.plans.errors import Violation
from orch.plans.spec import Accelerator, ClusterSpec, FSDPSpec, Offload, OptimSpec, PlanSpec, Precision, Recompute

if TYPE_CHECKING:
    from orch.plans.engine_settings import EngineSettings
    from orch.plans.memory.activations import ActivationBytes
    from orch.plans.memory.build import BuildMemory
    from orch.plans.memory.estimate import ModelProbe
    from orch.plans.memory.states import DevicePhases, ModelStateBytes
    from orch.plans.optim_settings import OptimSettings
    from orch.plans.parallel.pipeline import PipelineStage
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.search.space import SearchSpace
    from orch.plans.step_time.cost_model import ModelCost, Speeds, StepTime


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One device's memory under a plan, as its engine lays the model out."""

    per_stage: list[tuple[ModelStateBytes, DevicePhases]]
    """Model states and step phases of each pipeline stage (one entry without pipelining)."""
    pipeline: list[PipelineStage] = field(default_factory=list)
    """The pipeline's stages (empty without pipelining)."""
    detail: object | None = None
    """The engine's own part-by-part account, shown by `orch check` (FSDP2's
    :class:`orch.plans.engines.fsdp2_memory.FSDPMemory`)."""


Change = tuple[str, dict]
"""A fix: what to tell the user, and the plan fields it changes (``fsdp.<name>`` for FSDP2's settings)."""


def declared_recompute(plan: PlanSpec) -> Recompute | None:
    """The recomputation policy ``plan`` declares, or None where it names none
    (:func:`orch.plans.resolve.resolve_plan` reports that)."""
    try:
        return Recompute.of(plan.activation_checkpointing)
    except ValueError:
        return None


class EngineSpec:
    """One training engine as the planner knows it. Subclasses set the class attributes and
    override what their engine does differently; the defaults are ones every engine shares."""

    name: ClassVar[str]
    """The ``plan.engine`` value that selects it."""
    runtime: ClassVar[str]
    """Its runtime class, ``module:Class`` (an :class:`orch.launchers.engines.base.Engine`). The
    module is a package that also holds the driver's parts (``driver``, ``export``)."""
    summary: ClassVar[str]
    """One line for `orch check` and the docs: what it is and what it shards."""
    buffers_label: ClassVar[str]
    """The name `orch check` gives the engine's own buffers in a device's breakdown."""
    tracked_settings: ClassVar[tuple[str, ...]] = ()
    """Its plan settings, as override keys under ``plan.`` (``zero_stage``, ``fsdp.hybrid``):
    what the one-line plan, the tracked parameters and `orch report` show of it."""
    splits_fused_tp_layers: ClassVar[bool] = True
    """Its tensor parallelism can split fused layers (q, k and v stacked in one weight)."""
    resume_keeps: ClassVar[tuple[str, ...]] = ("tp", "pp")
    """The layout keys (:func:`orch.launchers.checkpoint.layout_of`) its checkpoints must be resumed
    with unchanged; the others (dp, micro-batch, accumulation) may change on resume."""
    compiles: ClassVar[bool] = False
    """It runs ``plan.compile`` (torch.compile of each repeated block)."""
    reads_fsdp_settings: ClassVar[bool] = False
    """It reads ``plan.fsdp.*`` (elsewhere a setting changed there is refused as ignored)."""
    pipeline_schedules: ClassVar[tuple[str, ...]] = ("1f1b",)
    """The ``plan.pp_schedule`` values it runs (:class:`orch.plans.spec.PipelineSchedule`)."""
    sequence_parallel: ClassVar[bool] = False
    """It splits the residual stream along the sequence over the tensor-parallel ranks
    (``plan.sequence_parallel``)."""
    async_tp: ClassVar[bool] = False
    """It overlaps the sequence-parallel collectives with their matmuls (``plan.async_tp``)."""
    fp8: ClassVar[bool] = False
    """It trains in ``plan.precision=fp8`` (FP8 matmuls in the repeated blocks' linear layers)."""
    context_parallel: ClassVar[bool] = False
    """It splits each sample's sequence over ``plan.cp`` ranks, attention gathering keys and values."""
    loss_parallel: ClassVar[bool] = False
    """It splits the output head over the vocabulary across the tensor-parallel ranks and computes the
    loss from the split logits (``plan.loss_parallel``); otherwise the head stays whole on every rank."""
    stages_recompute_every_n: ClassVar[bool] = True
    """Its pipeline stages checkpoint every n-th block (``plan.recompute_every_n_layers``), not
    only every block."""

    # What the user declared

    def violations(self, plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
        """What this engine cannot train of ``plan`` on ``cluster``, each with its fix."""
        found = [] if self.reads_fsdp_settings else _ignored_fsdp_settings(plan)
        if plan.pp > 1 and _schedule_name(plan.pp_schedule) not in self.pipeline_schedules:
            from orch.plans.engines import engine_names, engine_spec

            schedule = _schedule_name(plan.pp_schedule)
            others = [name for name in engine_names() if schedule in engine_spec(name).pipeline_schedules]
            fix = f"set plan.pp_schedule={self.pipeline_schedules[0]}"
            found.append(Violation("plan.pp_schedule", schedule,
                                   f"the {self.name} engine runs the pipeline schedules "
                                   f"{', '.join(self.pipeline_schedules)}.",
                                   fix + (f", or plan.engine={others[0]}" if others else "")))
        if plan.compile and not self.compiles:
            from orch.plans.engines import engine_names, engine_spec

            others = [name for name in engine_names() if engine_spec(name).compiles]
            found.append(Violation("plan.compile", True,
                                   f"the {self.name} engine does not compile: torch.compile of each block runs in "
                                   f"the {', '.join(others)} engine (before sharding).",
                                   f"set plan.engine={others[0]} to compile, or plan.compile=false"))
        every = plan.recompute_every_n_layers
        if plan.pp > 1 and not self.stages_recompute_every_n and declared_recompute(plan) \
                and isinstance(every, int) and every > 1:
            from orch.plans.engines import engine_names, engine_spec

            others = [name for name in engine_names() if engine_spec(name).stages_recompute_every_n]
            found.append(Violation("plan.recompute_every_n_layers", every,
                                   f"the {self.name} engine's pipeline stages checkpoint every layer, not every "
                                   f"n-th (plan.pp={plan.pp}).",
                                   "set plan.recompute_every_n_layers=1"
                                   + (f", or plan.engine={others[0]} (whose pipeline stages checkpoint every n-th "
                                      "block)" if others else "")))
        if plan.sequence_parallel:
            found += self._sequence_parallel_violations(plan)
        if plan.async_tp:
            found += self._async_tp_violations(plan, cluster.accelerator)
        if plan.precision == Precision.fp8:
            found += self._fp8_violations(cluster)
        if plan.cp > 1:
            found += self._context_parallel_violations(plan)
        return found

    def _lacks(self, capability: str, key: str, value: object, why: str, what: str, off: str) -> Violation:
        """The refusal of a setting this engine does not run (``capability``: the spec attribute
        that says an engine runs it), naming the engines that do: ``why``; ``what`` runs in them."""
        from orch.plans.engines import engine_names, engine_spec

        others = [name for name in engine_names() if getattr(engine_spec(name), capability)]
        return Violation(key, value, f"{why}; {what} runs in the {', '.join(others)} engine.",
                         f"set plan.engine={others[0]}, or {off}")

    def _fp8_violations(self, cluster: ClusterSpec | None) -> list[Violation]:
        """Why this engine cannot train in FP8 on ``cluster`` (None: not known yet, the tuner's
        structural rules)."""
        if not self.fp8:
            return [self._lacks("fp8", "plan.precision", "fp8", f"the {self.name} engine multiplies in the training "
                                "precision", "FP8 training (torchao's float8)", "plan.precision=bf16")]
        if cluster is None:
            return []
        if cluster.accelerator != Accelerator.gpu:
            return [Violation("plan.precision", "fp8",
                              f"FP8 matmuls run on GPUs that have them (H100, H200), and cluster.accelerator="
                              f"{cluster.accelerator.value} only emulates them.", "set plan.precision=bf16")]
        if not cluster.device_fp8_tflops:
            return [Violation("plan.precision", "fp8",
                              "cluster.device_fp8_tflops is not set: the cluster declares no FP8 matmuls (an A100 "
                              "has none).", "set cluster.device_fp8_tflops to the GPU's dense FP8 rate (H100 SXM "
                              "and H200: 1979) if it has FP8 matmuls, else plan.precision=bf16")]
        if cluster.device_tflops is None:
            from orch.plans.step_time.cost_model import DECLARED_SPEEDS

            # FP8 is priced as a multiple of the bf16 rate: against the default (an A100's) an H100's
            # FP8 would run 6.3x as fast as its bf16 instead of 2x, and win every plan.
            return [Violation("plan.precision", "fp8",
                              f"cluster.device_fp8_tflops={cluster.device_fp8_tflops:g} prices FP8 matmuls against the "
                              "same GPU's bf16 rate, and cluster.device_tflops is not set (its default is an A100's "
                              f"{DECLARED_SPEEDS['gpu']['device_tflops']:g}).",
                              "set cluster.device_tflops to the GPU's dense bf16 rate (H100 SXM and H200: 989)")]
        from importlib.util import find_spec

        if find_spec("torchao") is None:
            return [Violation("plan.precision", "fp8",
                              "FP8 training is torchao's (torchao.float8), which is not installed.",
                              "pip install torchao (orch's fp8 extra), or set plan.precision=bf16")]
        return []

    def _async_tp_violations(self, plan: PlanSpec, accelerator: Accelerator | None) -> list[Violation]:
        """Why this engine cannot overlap ``plan``'s tensor-parallel collectives with its matmuls
        (``plan.async_tp=true``); ``accelerator`` None: the cluster is not known yet (the tuner's
        structural rules)."""
        if not self.async_tp:
            return [self._lacks("async_tp", "plan.async_tp", True, f"the {self.name} engine runs each tensor-parallel "
                                "collective on its own", "async TP", "plan.async_tp=false")]
        found = []
        if plan.tp <= 1:
            found.append(Violation("plan.async_tp", True,
                                   f"async TP overlaps the tensor-parallel ranks' collectives, and plan.tp={plan.tp}.",
                                   "set plan.tp to 2 or more, or plan.async_tp=false"))
        if not plan.sequence_parallel:
            found.append(Violation("plan.async_tp", True,
                                   "async TP splits the all-gather before each column-parallel matmul and the "
                                   "reduce-scatter after each row-parallel one, which sequence parallelism runs, "
                                   "and plan.sequence_parallel=false.",
                                   "set plan.sequence_parallel=true, or plan.async_tp=false"))
        if not plan.compile:
            found.append(Violation("plan.async_tp", True,
                                   "async TP is a pass of torch.compile (Inductor's micro-pipelined TP) over each "
                                   "compiled block, and plan.compile=false.",
                                   "set plan.compile=true, or plan.async_tp=false"))
        if accelerator is not None and accelerator != Accelerator.gpu:
            found.append(Violation("plan.async_tp", True,
                                   "async TP moves the collectives' chunks through symmetric memory shared by the "
                                   f"GPUs of a node (CUDA), and cluster.accelerator={accelerator.value}.",
                                   "set plan.async_tp=false (it runs on GPUs only)"))
        return found

    def _context_parallel_violations(self, plan: PlanSpec) -> list[Violation]:
        """Why this engine cannot split each sample's sequence over ``plan.cp`` ranks."""
        if not self.context_parallel:
            return [self._lacks("context_parallel", "plan.cp", plan.cp, f"the {self.name} engine keeps each "
                                "sample's whole sequence on a rank", "context parallelism", "plan.cp=1")]
        return []

    def _sequence_parallel_violations(self, plan: PlanSpec) -> list[Violation]:
        """Why this engine cannot split the sequence for ``plan`` (``plan.sequence_parallel=true``)."""
        if not self.sequence_parallel:
            return [self._lacks("sequence_parallel", "plan.sequence_parallel", True, f"the {self.name} engine's "
                                "tensor parallelism keeps the whole sequence on every rank", "sequence parallelism",
                                "plan.sequence_parallel=false")]
        if plan.tp <= 1:
            return [Violation("plan.sequence_parallel", True,
                              f"sequence parallelism splits the sequence over the tensor-parallel ranks, and "
                              f"plan.tp={plan.tp}.", "set plan.tp to 2 or more, or plan.sequence_parallel=false")]
        return []

    def rejection(self, plan: PlanSpec) -> str | None:
        """Why the tuner never runs ``plan`` under this engine, in a few fixed words (they are
        counted across many plans), or None. The long form is :meth:`violations`."""
        if plan.pp > 1 and _schedule_name(plan.pp_schedule) not in self.pipeline_schedules:
            return f"pipeline schedule {plan.pp_schedule} (the engine runs {', '.join(self.pipeline_schedules)})"
        if plan.sequence_parallel and self._sequence_parallel_violations(plan):
            return "sequence parallelism (tp > 1, fsdp2)"
        if plan.precision == Precision.fp8 and self._fp8_violations(None):
            return "fp8 matmuls (fsdp2)"
        if plan.async_tp and self._async_tp_violations(plan, None):
            return "async TP (fsdp2, tp > 1, sequence parallel, compile)"
        if plan.cp > 1 and self._context_parallel_violations(plan):
            return "context parallelism (fsdp2)"
        return None

    def resume_problem(self, saved: Mapping[str, object], plan: PlanSpec | ResolvedPlan) -> str | None:
        """Why a checkpoint written with layout ``saved`` cannot resume ``plan``, in a few words, or
        None. A run that re-plans after losing devices takes only plans its checkpoint resumes."""
        changed = [key for key in self.resume_keeps if key in saved and saved[key] != getattr(plan, key)]
        if changed:
            return f"{self.name} checkpoints resume with the same {' and '.join(changed)}"
        return None

    def elastic_violations(self, plan: PlanSpec) -> list[Violation]:
        """Why this plan's checkpoints cannot resume on fewer devices (``train.elastic``), each with its fix."""
        return []

    def setting(self, plan: ResolvedPlan, key: str) -> object:
        """The value of one of :attr:`tracked_settings` in ``plan``."""
        head, _, tail = key.partition(".")
        value = getattr(getattr(plan, head), tail) if tail else getattr(plan, head)
        return value.value if hasattr(value, "value") else value

    def short_settings(self, plan: ResolvedPlan) -> str:
        """Its settings in the tuner's compact line (``zero=2``, ``reshard=on``)."""
        return " ".join(f"{key.rsplit('.', 1)[-1]}={self.setting(plan, key)}" for key in self.tracked_settings)

    def short_offload(self, plan: ResolvedPlan) -> str:
        """Where the plan offloads, in the tuner's compact line."""
        return plan.offload_optimizer.value + ("+param" if plan.offload_param != Offload.none else "")

    def run_label(self, params: dict[str, str]) -> str:
        """The sharding column of `orch runs` for a run's tracked parameters (``plan.<key>``)."""
        return self.name

    # What the plan costs

    def settings(self, plan: ResolvedPlan, optim: OptimSpec | OptimSettings,
                 param_count: int | None = None) -> EngineSettings:
        """The engine settings of ``plan`` (see :func:`orch.plans.engine_settings.engine_settings`)."""
        raise NotImplementedError

    def device_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe,
                      engine: EngineSettings, activations: ActivationBytes) -> DeviceMemory:
        """What one device holds and adds through a step (``activations``: the whole model's)."""
        raise NotImplementedError

    def build_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, *, built_bytes: int, param_count: int,
                     stages: list[PipelineStage], weight_file_bytes: int) -> BuildMemory:
        """One node's host memory while its workers build the model: by default each builds it whole."""
        from orch.plans.memory.build import GIB, BuildMemory

        return BuildMemory(model=built_bytes, weights=weight_file_bytes,
                           workers=min(cluster.devices_per_node, plan.world_size), how="whole",
                           capacity=int(cluster.host_memory_gib * GIB))

    def fixes(self, plan: ResolvedPlan) -> list[Change]:
        """Single changes to try, cheapest first, when ``plan`` does not fit."""
        changes: list[Change] = []
        if not plan.activation_checkpointing:
            changes.append(("set plan.activation_checkpointing=selective",
                            {"activation_checkpointing": Recompute.selective}))
        if plan.activation_checkpointing != Recompute.full:
            changes.append(("set plan.activation_checkpointing=full", {"activation_checkpointing": Recompute.full}))
        return changes

    def step_time(self, plan: ResolvedPlan, model: ModelCost, speeds: Speeds, *, devices_per_node: int,
                  optim: OptimSpec, probe: ModelProbe | None = None) -> StepTime:
        """The predicted optimizer step (``probe``: the model, when the engine reads more of it)."""
        from orch.plans.step_time.cost_model import predict_step

        return predict_step(plan, model, speeds, devices_per_node=devices_per_node, optim=optim)

    # What the tuner tries

    def search_settings(self, space: SearchSpace, pp: int) -> list[tuple[int, FSDPSpec]]:
        """(``plan.zero_stage``, ``plan.fsdp``) pairs to try at pipeline degree ``pp``."""
        raise NotImplementedError

    def offloads(self, space: SearchSpace, zero_stage: int) -> list[tuple[Offload, Offload]]:
        """(optimizer, parameter) offload pairs this engine can express at ``zero_stage``."""
        return [(where, where) for where in space.offload]

    def pipeline_partition(self, layers: list[tuple[str, int]], pp: int, method: str) -> list[int]:
        """Stage boundaries (``pp + 1`` indices) of ``layers`` ((class name, trainable parameters)
        each) split into ``pp`` stages by ``plan.pp_partition=method``, as the engine splits them."""
        raise ValueError(f"plan.engine={self.name} runs no pipeline stages")

    def pipeline_layer_problem(self, layers: list) -> str | None:
        """Why this engine cannot build ``layers`` (a model's ``pipeline_layers()``) into its
        pipeline, or None; `orch check` asks before any worker starts."""
        return None

    # What the model's code may ask

    def whole_parameters(self, params: list) -> AbstractContextManager | None:
        """A context in which ``params``, partitioned by this engine while the model was built,
        are whole and writable (to initialise them); None when it partitioned none of them."""
        return None


def halve_micro_batch(plan: ResolvedPlan) -> list[Change]:
    """The fix every engine offers: half the micro-batch, twice the accumulation (same global batch)."""
    if plan.micro_batch_size <= 1:
        return []
    half = plan.micro_batch_size // 2
    return [(f"halve plan.micro_batch_size to {half} (and double plan.grad_accum_steps to "
             f"{plan.grad_accum_steps * 2} to keep the global batch)",
             {"micro_batch_size": half, "grad_accum_steps": plan.grad_accum_steps * 2})]


def schema_default(name: str) -> object:
    """The default of ``PlanSpec.<name>``, as the schema declares it."""
    return next(f.default for f in dataclasses.fields(PlanSpec) if f.name == name)


def _ignored_fsdp_settings(plan: PlanSpec) -> list[Violation]:
    """Each ``plan.fsdp.*`` key set away from its default under an engine that never reads it."""
    found = []
    for f in dataclasses.fields(FSDPSpec):
        value, default = getattr(plan.fsdp, f.name), f.default
        if value != default:
            found.append(Violation(f"plan.fsdp.{f.name}", value,
                                   f"is an FSDP2 setting, which plan.engine={plan.engine} ignores.",
                                   f"set plan.engine=fsdp2 to use it, or leave plan.fsdp.{f.name} at its default "
                                   f"({str(default).lower()})"))
    return found


def _schedule_name(value: object) -> str:
    """``plan.pp_schedule`` as its name, given as the name or the enum member."""
    return str(getattr(value, "value", value))
