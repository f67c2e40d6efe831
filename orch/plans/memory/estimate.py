"""Per-device and per-node memory of a resolved plan, the verdict, and the fixes that would fit.

Combines the pure pieces: parameter counts of the model built on ``meta``
(:mod:`orch.plans.memory.states`), activations measured by running its forward and backward on ``meta``
(:mod:`orch.plans.memory.activations`), and DeepSpeed's buffers read from the generated DeepSpeed config.
The peak of a device is what it holds between steps plus the worst phase of a step
(:func:`orch.plans.memory.states.step_phases`). Nothing is allocated, so a 175B-parameter model is checked
in seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from orch.plans.engine_settings import EngineSettings, ZeroStage, engine_settings
from orch.plans.engines import engine_spec
from orch.plans.engines.fsdp2_memory import FSDPUnits, fsdp_units
from orch.plans.errors import PlanError, Violation, first_line
from orch.plans.memory.activations import (
    ActivationBytes,
    activations_from_shallow,
    attention_kernels,
    context_parallel_on_meta,
    measure_activations,
    partly_checkpointed,
)
from orch.plans.memory.build import GIB, BuildMemory, build_memory, build_violation, format_bytes
from orch.plans.memory.states import (
    DevicePhases,
    MemoryBreakdown,
    ModelStateBytes,
    ModelStats,
    memory_breakdown,
    model_stats,
    stage3_persistent_params,
)
from orch.plans.model.attention import KernelLog
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS, ShallowModels
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import (
    ModelInputs,
    batch_bytes,
    checkpoint_units,
    selective_problem,
    supports_activation_checkpointing,
)
from orch.plans.parallel.context_parallel import LocalSequenceInputs
from orch.plans.parallel.pipeline import (
    PipelineLayer,
    PipelineStage,
    carry_layers,
    measure_pipeline_layers,
    on_sequence_part,
    partition,
    pipeline_stages,
    rank_stages,
)
from orch.plans.parallel.sequence_parallel import (
    SequenceParallelLayout,
    layout_of,
    split_sequence_on_meta,
)
from orch.plans.parallel.split_loss import split_loss_on_meta
from orch.plans.parallel.stage_layers import declared
from orch.plans.parallel.tp_plan import shard_module, split_params
from orch.plans.parallel.vocab_parallel import OutputHead, describe_head, output_head, splits_head
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, ClusterSpec, Offload, OptimSpec, PipelineSchedule, Precision, Recompute

# The keys of one device in `orch check --json` (``per_device`` and each of ``stages``), in bytes
# but for ``phase``, the step phase the peak falls in.
DEVICE_JSON_KEYS = ("params", "grads", "optimizer_states", "activations", "buffers", "reserve", "total",
                    "capacity", "held", "phase")


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """What one node's host memory must hold for its local workers."""

    offloaded: int
    """Offloaded parameters, gradients and optimizer states of all local ranks."""
    device_share: int
    """On CPU workers the "device" is host memory too: the local workers' device totals."""
    total: int
    capacity: int
    nvme: int = 0
    """States offloaded to NVMe by all local ranks (on the node's disk, not in its memory)."""

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True, kw_only=True)
class PlanEstimate:
    """The planner's answer for one plan on one cluster."""

    plan: ResolvedPlan
    model: ModelStats
    per_device: MemoryBreakdown
    """The most loaded device."""
    stages: list[MemoryBreakdown]
    """One entry per pipeline stage (a single entry without pipelining)."""
    pipeline: list[PipelineStage] = field(default_factory=list)
    """With plan.pp > 1: each stage's layers and parameters, in the order of ``stages``."""
    per_node_host: HostMemory
    build: BuildMemory | None = None
    """One node's host memory while its workers build the model, before training."""
    states: ModelStateBytes | None = None
    """The ZeRO paper's model states of the most loaded rank (gradients included, as in its Table 1)."""
    host_per_device: int = 0
    """Host bytes one rank's offloaded states and staging buffers take (in the worker's own
    process on CPU workers, where "device" and host memory are the same RAM)."""
    phases: DevicePhases | None = None
    """The most loaded device through a step: what it holds and what each phase adds."""
    violations: list[Violation] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    """Smallest plan changes that would make an infeasible plan fit."""
    attention: str = ""
    """The attention kernel the activations were measured with (:meth:`ModelProbe.attention`)."""
    output_head: str = ""
    """How the tensor-parallel ranks hold the output head (:func:`orch.plans.parallel.vocab_parallel.describe_head`)."""
    engine_detail: object | None = None
    """The engine's own part-by-part account of the rank (FSDP2's
    :class:`orch.plans.engines.fsdp2_memory.FSDPMemory`: sharded states, gathered blocks, reduce-scatter
    buffers), or None."""

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def bubble(self) -> float:
        """Pipeline idle time relative to useful work under the plan's schedule (0 without pp):
        (pp - 1) / micro-batches for 1F1B, less for the interleaved and zero-bubble ones
        (:func:`orch.plans.parallel.schedules.bubble_micro_batches`)."""
        from orch.plans.parallel.schedules import bubble_micro_batches

        if self.plan.pp <= 1:
            return 0.0
        return bubble_micro_batches(self.plan.pp_schedule, self.plan.pp, self.plan.pp_virtual_stages) / max(
            self.plan.grad_accum_steps, 1)

    def as_json(self) -> dict:
        """The stable ``orch check --json`` document (other tools read these names)."""

        def device(b: MemoryBreakdown) -> dict:
            # The components are the bytes alive at the peak, in ``phase``; they add up to total.
            return {k: getattr(b, k) for k in DEVICE_JSON_KEYS}

        phases = {}
        if self.phases is not None:
            phases = {p.phase: {**dataclasses.asdict(p), "total": p.total}
                      for p in [self.phases.held, *self.phases.phases]}

        return {
            "feasible": self.feasible,
            "world_size": self.plan.world_size,
            "plan": self.plan.as_dict(),
            "model": dataclasses.asdict(self.model),
            "per_device": device(self.per_device),
            "per_node_host": {"total": self.per_node_host.total, "capacity": self.per_node_host.capacity,
                              "offloaded": self.per_node_host.offloaded,
                              "device_share": self.per_node_host.device_share,
                              "nvme": self.per_node_host.nvme,
                              "build": self.build.total if self.build else 0},
            "stages": [device(s) for s in self.stages],
            "pipeline": {"bubble_fraction": self.bubble, "stages": [dataclasses.asdict(s) for s in self.pipeline]},
            "phases": phases,
            "violations": [{"field": v.field, "message": f"{v.message} Fix: {v.fix}"} for v in self.violations],
            "suggestions": list(self.suggestions),
            "attention": self.attention,
            "fsdp": None,
        } | ({} if self.engine_detail is None else
             {self.engine_detail.json_key: self.engine_detail.as_json(self.per_device.phase)})


def _on_meta(factory: Callable[[], torch.nn.Module],
             change: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    with meta_device():
        return change(factory())


class ModelProbe:
    """A model built once on ``meta``, with its activation measurements cached.

    The tuner and the fix search estimate many plans of one model; parameter counts never
    change and activations only depend on (micro-batch, precision, checkpointing). A deep model
    is built at two shallow depths instead (``shallow``) and every count carried to its depth.
    """

    def __init__(self, factory: Callable[[], torch.nn.Module], inputs: ModelInputs,
                 tp_layer_specs: list[dict] | None = None, pipeline_layers: Callable[[], list] | None = None,
                 shallow: ShallowModels | None = None, weight_file_bytes: int = 0):
        self.factory = factory
        self.weight_file_bytes = weight_file_bytes
        """Bytes of the weight files the model's constructor reads (a pretrained checkpoint)."""
        self.inputs = inputs
        """The data source's example batch and the objective the model is measured through."""
        self.tp_layer_specs = tp_layer_specs or []
        self.pipeline_layers = pipeline_layers
        """The model's pipeline layers factory (None: the model cannot be pipelined); with ``shallow``,
        it also takes a depth (``pipeline_layers(2)``: the layers of the model with 2 blocks)."""
        self.shallow = shallow
        """The model built at two shallow depths, when it is deep
        (:func:`orch.plans.model.model_facts.inspect_shallow`):
        then every count is carried from them to its depth, and the full-depth model is built
        only if a measurement cannot be carried (see :meth:`_measure`)."""
        self._pipeline = functools.lru_cache(maxsize=None)(self._measure_pipeline)
        self._stages = functools.lru_cache(maxsize=None)(self._split)
        self._ranks = functools.lru_cache(maxsize=None)(self._rank_stages)
        self.stats = (model_stats(self.module) if shallow is None else
                      shallow.at_depth(model_stats, keep=("largest_layer_params", "largest_param")))
        self._measured = functools.lru_cache(maxsize=None)(self._measure_or_refusal)
        self._kernels = functools.lru_cache(maxsize=None)(self._attention_kernels)
        self._fsdp_units: dict[int, FSDPUnits] = {}

    @functools.cached_property
    def module(self) -> torch.nn.Module:
        """The model at its full depth on ``meta``, built on first use."""
        with meta_device():
            return self.factory()

    def _options(self) -> dict:
        """A subclass's own constructor arguments, which :meth:`_with_specs` passes on."""
        return {}

    def _with_specs(self, tp_layer_specs: list[dict]) -> ModelProbe:
        """A probe of the same model and inputs that shards its tensor-parallel copies by
        ``tp_layer_specs``, with caches of its own; the model built on ``meta`` is shared (every
        sharded copy is a deep copy of it)."""
        variant = type(self)(self.factory, self.inputs, tp_layer_specs=tp_layer_specs,
                             pipeline_layers=self.pipeline_layers, shallow=self.shallow,
                             weight_file_bytes=self.weight_file_bytes, **self._options())
        if "module" in self.__dict__:
            variant.__dict__["module"] = self.module
        return variant

    @functools.cached_property
    def output_head(self) -> OutputHead | None:
        """The output head ``plan.loss_parallel`` can split over the vocabulary, or None
        (:func:`orch.plans.parallel.vocab_parallel.output_head`; a shallow copy's is the model's)."""
        return output_head(self.sample, self.inputs.objective)

    @functools.cached_property
    def split_head(self) -> ModelProbe | None:
        """This probe with the output head split over the tensor-parallel ranks as well, for the
        plans that split it (:meth:`for_plan`); None for a model without such a head."""
        if self.output_head is None or not self.tp_layer_specs:
            return None
        return self._with_specs([*self.tp_layer_specs, self.output_head.layer_spec])

    @property
    def splits_output_head(self) -> bool:
        """Whether this probe's tensor-parallel copies split the output head (:attr:`split_head`)."""
        return self.output_head is not None and self.output_head.layer_spec in self.tp_layer_specs

    @functools.cached_property
    def output_head_params(self) -> int:
        """The parameters of the output head :attr:`output_head` names, a tied head's embedding's
        (0 without one)."""
        if self.output_head is None:
            return 0
        return sum(p.numel() for p in self.sample.get_submodule(self.output_head.weight_owner).parameters())

    def for_plan(self, plan: ResolvedPlan) -> ModelProbe:
        """The probe that counts ``plan``'s tensor-parallel ranks as its engine shards them: with the
        output head split (:func:`orch.plans.parallel.vocab_parallel.splits_head`) or not."""
        if plan.tp > 1 and self.split_head is not None and splits_head(plan, self.output_head):
            return self.split_head
        return self

    @property
    def sample(self) -> torch.nn.Module:
        """A module with the model's layers, cheapest to inspect: a shallow copy when there is one."""
        return self.shallow.deeper if self.shallow is not None else self.module

    def _count(self, count: Callable[[torch.nn.Module], int]) -> int:
        """``count`` of the full-depth model, carried from the shallow copies when there are some."""
        return count(self.module) if self.shallow is None else self.shallow.at_depth(count)

    @functools.cached_property
    def tensor_parallel_params(self) -> tuple[int, int]:
        """(all, trainable) parameters that tensor parallelism shards, per the AutoTP layer specs."""
        specs = self.tp_layer_specs
        return (self._count(lambda m: _tensor_parallel_params(m, specs)[0]),
                self._count(lambda m: _tensor_parallel_params(m, specs)[1]))

    def stats_for(self, tp: int) -> ModelStats:
        """Parameter counts one rank holds when the model is split ``tp`` ways."""
        if tp <= 1:
            return self.stats
        sharded, sharded_trainable = self.tensor_parallel_params
        return dataclasses.replace(
            self.stats, param_count=self.stats.param_count - sharded + -(-sharded // tp),
            trainable_count=self.stats.trainable_count - sharded_trainable + -(-sharded_trainable // tp))

    def _measure(self, micro_batch_size: int, precision: Precision, checkpointing: bool,
                 tp: int = 1, accelerator: Accelerator = Accelerator.cpu,
                 sequence_parallel: bool = False, cp: int = 1) -> ActivationBytes:
        if cp > 1:
            # One context-parallel rank: its part of every sequence, attention over the gathered keys.
            with context_parallel_on_meta(cp):
                return self._measure_inputs(LocalSequenceInputs(self.inputs, cp), micro_batch_size, precision,
                                            checkpointing, tp, accelerator, sequence_parallel)
        return self._measure_inputs(self.inputs, micro_batch_size, precision, checkpointing, tp, accelerator,
                                    sequence_parallel)

    def _measure_inputs(self, inputs: ModelInputs, micro_batch_size: int, precision: Precision,
                        checkpointing: bool, tp: int, accelerator: Accelerator,
                        sequence_parallel: bool) -> ActivationBytes:
        args = dict(micro_batch_size=micro_batch_size, inputs=inputs, dtype=precision.dtype,
                    checkpointing=checkpointing, accelerator=accelerator)

        def sharded(module: torch.nn.Module) -> torch.nn.Module:
            module = shard_module(module, self.tp_layer_specs, tp)
            return split_sequence_on_meta(module, self.tp_layer_specs, tp) if sequence_parallel else module

        # With the head split over the vocabulary, its loss runs as torch's loss_parallel runs it.
        with split_loss_on_meta(tp > 1 and self.splits_output_head):
            if self.shallow is not None:
                shallow = self.shallow if tp <= 1 else self.shallow.map(lambda m: sharded(copy.deepcopy(m)))
                carried = activations_from_shallow(shallow, **args)
                if carried is not None:
                    return carried
            factory = self.factory if tp <= 1 else functools.partial(_on_meta, self.factory, sharded)
            return self._measure_built(factory, **args)

    def _measure_built(self, factory: Callable[[], torch.nn.Module], **args) -> ActivationBytes:
        """The activations of the model ``factory`` builds (on ``meta``, sharded or split as the
        plan runs it), counted over every layer."""
        return measure_activations(factory, **args)

    def _measure_or_refusal(self, *args) -> ActivationBytes | ValueError:
        """:meth:`_measure`, or the ValueError of a model that refuses the micro-batch in training,
        kept as a measurement is: a search asks again for every plan at that micro-batch, and each
        try is a forward and backward pass (half a second for a ResNet-50 on ``meta``)."""
        try:
            return self._measure(*args)
        except ValueError as error:
            return error

    def _activations(self, *args) -> ActivationBytes:
        """The activations :meth:`_measure` counts for ``args``, measured once; a refusal raised again."""
        measured = self._measured(*args)
        if isinstance(measured, ValueError):
            raise measured.with_traceback(None)
        return measured

    def activations(self, plan: ResolvedPlan) -> ActivationBytes:
        """The plan's activations, or a PlanError when the model refuses its micro-batch in training
        (a BatchNorm needs two values per channel: one sample at a 1x1 feature map is refused)."""
        def measured(policy: Recompute) -> ActivationBytes:
            return self._activations(plan.micro_batch_size, plan.precision, policy, plan.tp,
                                     plan.accelerator, plan.sequence_parallel and plan.tp > 1, plan.cp)
        try:
            policy = measured(plan.activation_checkpointing)
            if plan.activation_checkpointing and plan.recompute_every_n_layers > 1:
                return partly_checkpointed(measured(Recompute.none), policy, plan.recomputed_share(self.blocks))
            return policy
        except ValueError as error:
            raise PlanError([Violation(
                "plan.micro_batch_size", plan.micro_batch_size,
                f"the model refuses a training micro-batch of {plan.micro_batch_size}: "
                f"{type(error).__name__}: {first_line(error)}.",
                "raise plan.micro_batch_size (and lower plan.grad_accum_steps to keep the global batch)")]) from error

    @functools.cached_property
    def blocks(self) -> int:
        """The repeated blocks activation checkpointing recomputes one at a time, at full depth."""
        return self._count(lambda m: len(checkpoint_units(m)))

    def _attention_kernels(self, precision: Precision, accelerator: Accelerator) -> KernelLog:
        return attention_kernels(self.sample, inputs=self.inputs, dtype=precision.dtype, accelerator=accelerator)

    def attention(self, plan: ResolvedPlan) -> str:
        """Which attention kernel the activations were measured with, in one line."""
        kernels = self._kernels(plan.precision, plan.accelerator).describe(plan.accelerator)
        if plan.cp > 1:
            # The engine's split attention masks every chunk but the first (a kernel that takes a mask).
            kernels += f"; split over cp={plan.cp} ranks, keys and values gathered, each chunk causally masked"
        return kernels

    def _measure_pipeline(self, micro_batch_size: int, precision: Precision, tp: int = 1) -> list[PipelineLayer]:
        if self.pipeline_layers is None:
            raise ValueError("the model declares no pipeline layers")
        def measure(layers: list) -> list[PipelineLayer]:
            # One tensor-parallel rank's bytes, the head's loss split as the whole model's is (_measure).
            with split_loss_on_meta(tp > 1 and self.splits_output_head):
                return measure_pipeline_layers(layers, micro_batch_size=micro_batch_size, inputs=self.inputs,
                                               dtype=precision.dtype, tp_layer_specs=self.tp_layer_specs, tp=tp)

        if self.shallow is not None:  # building every layer of a deep model costs what building it does
            carried = carry_layers(*(measure(self.pipeline_layers(d)) for d in SHALLOW_DEPTHS), self.shallow.depth)
            if carried is not None:
                return carried
        return measure(self.pipeline_layers())

    def pipeline_layer_facts(self, plan: ResolvedPlan) -> list[PipelineLayer]:
        """Every pipeline layer of the model, measured for the plan's micro-batch and precision, on
        one context-parallel rank's part of the sequence and one tensor-parallel rank's shard."""
        return on_sequence_part(self._pipeline(plan.micro_batch_size, plan.precision, plan.tp), plan.cp)

    def stages(self, plan: ResolvedPlan) -> list[PipelineStage]:
        """The plan's pipeline stages; cached, since `orch check` validates the split and then
        estimates it, and the fix search estimates many variants of one plan."""
        return self._stages(plan.micro_batch_size, plan.precision, plan.pipeline_stages, plan.pp_partition,
                            plan.grad_accum_steps, plan.engine, plan.cp, plan.tp)

    def pipeline_ranks(self, plan: ResolvedPlan) -> list[PipelineStage]:
        """Each pipeline rank's stages as one, with the micro-batches its schedule holds in flight
        (:func:`orch.plans.parallel.pipeline.rank_stages`); cached as :meth:`stages` is: the tuner
        prices many plans of one pipeline (offload, resharding, compile, async TP)."""
        return self._ranks(plan.micro_batch_size, plan.precision, plan.pipeline_stages, plan.pp_partition,
                           plan.grad_accum_steps, plan.engine, plan.cp, plan.tp, plan.pp_schedule, plan.pp,
                           plan.pp_virtual_stages)

    def _rank_stages(self, micro_batch_size: int, precision: Precision, stages: int, method: str,
                     micro_batches: int, engine: str, cp: int, tp: int, schedule: PipelineSchedule, pp: int,
                     virtual: int) -> list[PipelineStage]:
        layers = on_sequence_part(self._pipeline(micro_batch_size, precision, tp), cp)
        return rank_stages(self._stages(micro_batch_size, precision, stages, method, micro_batches, engine, cp, tp),
                           layers, schedule=schedule, pp=pp, virtual=virtual, micro_batches=micro_batches)

    def _split(self, micro_batch_size: int, precision: Precision, pp: int, method: str,
               micro_batches: int, engine: str, cp: int = 1, tp: int = 1) -> list[PipelineStage]:
        inputs = self.inputs if cp <= 1 else LocalSequenceInputs(self.inputs, cp)
        layers = on_sequence_part(self._pipeline(micro_batch_size, precision, tp), cp)
        return pipeline_stages(layers, pp=pp, method=method, micro_batches=micro_batches, engine=engine,
                               input_bytes=self._input_bytes(inputs, micro_batch_size),
                               bounds=self._bounds(layers, precision, pp, method, engine))

    def _bounds(self, layers: list[PipelineLayer], precision: Precision, pp: int, method: str,
                engine: str) -> list[int]:
        """Where the stages of ``layers`` are cut (:func:`orch.plans.parallel.pipeline.partition`)."""
        return partition(layers, pp, method, engine)

    @staticmethod
    def _input_bytes(inputs: ModelInputs, micro_batch_size: int) -> int:
        """One micro-batch of the model's input."""
        return batch_bytes(inputs.example_batch(micro_batch_size))

    @property
    def pipeline_takes_positions(self) -> bool:
        """The model's pipeline layers take the positions of a part of the sequence (a layer class
        declares ``context_positions``, as the built-in GPT's embedding and
        :class:`orch.workloads.hf_pipeline.DecoderLayer` do)."""
        return declared(self.pipeline_sample or [], "context_positions")

    def fsdp_units(self, tp: int = 1) -> FSDPUnits:
        """The model's FSDP2 units (blocks and root) as one tensor-parallel rank holds them: the
        root and the largest block read off the model (a shallow copy's are the full depth's), the
        blocks together whatever the rank's parameters leave beside the root."""
        if tp not in self._fsdp_units:
            sample = self.sample if tp <= 1 else shard_module(copy.deepcopy(self.sample), self.tp_layer_specs, tp)
            units = fsdp_units(sample)
            stats = self.stats_for(tp)
            self._fsdp_units[tp] = dataclasses.replace(units, blocks=max(stats.param_count - units.root, 0))
        return self._fsdp_units[tp]

    @functools.cached_property
    def sequence_parallel(self) -> SequenceParallelLayout | str:
        """Where sequence parallelism splits the model (:mod:`orch.plans.parallel.sequence_parallel`),
        or why it cannot; read off a module with the model's layers (a shallow copy's blocks are the
        full depth's)."""
        return layout_of(self.sample, self.tp_layer_specs)

    @functools.cached_property
    def pipeline_sample(self) -> list | None:
        """The model's pipeline layers, of a shallow copy when there is one (what their kinds are
        read off), built once: building them instantiates the model's config (tens of
        milliseconds), and the tuner asks for every pipelined plan."""
        if self.pipeline_layers is None:
            return None
        return self.pipeline_layers(SHALLOW_DEPTHS[0]) if self.shallow is not None else self.pipeline_layers()

    @property
    def pipeline_takes_split_sequence(self) -> bool:
        """The model's pipeline layers take a sequence that arrives split (a layer class declares
        ``sequence_shards``, as :class:`orch.workloads.hf_pipeline.DecoderLayer` does)."""
        return declared(self.pipeline_sample or [], "sequence_shards")

    def persistent_params(self, engine: EngineSettings) -> int:
        """Parameters ZeRO-3 keeps whole on every rank (under the persistence threshold)."""
        if engine.zero_stage != ZeroStage.parameters:
            return 0
        threshold = engine.stage3_param_persistence_threshold
        return self._count(lambda m: stage3_persistent_params(m, threshold))


def _tensor_parallel_params(module: torch.nn.Module, layer_specs: list[dict]) -> tuple[int, int]:
    """(all, trainable) parameters of ``module`` the AutoTP layer specs shard.

    A spec names a layer's weight; a column-parallel layer's bias is split with it, a
    row-parallel layer's bias stays whole (DeepSpeed's LinearLayer / LinearAllreduce). A layer
    its spec skips, or whose weight is not a matrix, stays whole (:func:`orch.plans.parallel.tp_plan.split_layers`).
    """
    return split_params(module, layer_specs)


def estimate_plan(plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe) -> PlanEstimate:
    """Predict the peak bytes of every device and node for ``plan``; no fix search.

    The engine's buffers and limits are the plan's :func:`orch.plans.engine.engine_settings`, the
    same object the workers' DeepSpeed config is written from. An FSDP2 plan is counted part by
    part as ``fully_shard`` lays it out (:mod:`orch.plans.fsdp_memory`).

    With pipeline stages every stage is estimated on its own (its layers' parameters, its share
    of the activations times the micro-batches it holds in flight) and the most loaded one
    decides; gradients count as accumulating, since 1F1B runs later forwards while earlier
    micro-batches' gradients sit in ``.grad``.
    """
    capacity = int(cluster.device_memory_gib * GIB)
    probe = probe.for_plan(plan)
    engine = engine_settings(plan, optim, probe.stats.param_count)
    memory = engine_spec(plan.engine).device_memory(plan, cluster, optim, probe, engine, probe.activations(plan))
    per_stage, pipeline = memory.per_stage, memory.pipeline
    stages = [memory_breakdown(device=phases, capacity=capacity, accelerator=plan.accelerator)
              for _, phases in per_stage]
    worst = max(range(len(stages)), key=lambda i: stages[i].total)
    device, (states, phases) = stages[worst], per_stage[worst]
    local = cluster.devices_per_node
    # NVMe offload swaps the states to disk through buffers in host memory: the states count
    # against the disk, not the host's memory.
    nvme_per_device = (states.host_optimizer_states if plan.offload_optimizer == Offload.nvme else 0) + (
        states.host_params if plan.offload_param == Offload.nvme else 0)
    host_per_device = states.host_total + phases.host_buffers - nvme_per_device
    offloaded = host_per_device * local
    device_share = device.total * local if plan.accelerator == Accelerator.cpu else 0
    host = HostMemory(offloaded=offloaded, device_share=device_share, total=offloaded + device_share,
                      capacity=int(cluster.host_memory_gib * GIB), nvme=nvme_per_device * local)
    violations = []
    if not device.fits:
        where = f" on pipeline stage {worst}" if plan.pp > 1 else ""
        violations.append(Violation(
            "cluster.device_memory_gib", cluster.device_memory_gib,
            f"the plan needs {format_bytes(device.total)} per device{where} but a device has {format_bytes(capacity)} "
            f"(at its peak, in the {device.phase} phase: {_parts(device)}).",
            "see the suggested plan changes, or use devices with more memory"))
    if not host.fits:
        violations.append(Violation(
            "cluster.host_memory_gib", cluster.host_memory_gib,
            f"the plan needs {format_bytes(host.total)} of host memory per node "
            f"but a node has {format_bytes(host.capacity)} "
            f"({format_bytes(offloaded)} offloaded states of {local} workers"
            + (f" + {format_bytes(device_share)} of the CPU workers' own memory" if device_share else "") + ").",
            "offload less (plan.offload_optimizer / plan.offload_param), or use fewer workers per node"))
    build = build_memory(plan, cluster, built_bytes=probe.stats.built_bytes, param_count=probe.stats.param_count,
                         stages=pipeline, weight_file_bytes=probe.weight_file_bytes)
    if (refusal := build_violation(build)) is not None:
        violations.append(refusal)
    return PlanEstimate(plan=plan, model=probe.stats, per_device=device, stages=stages, pipeline=pipeline,
                        per_node_host=host, build=build, states=states, host_per_device=host_per_device, phases=phases,
                        violations=violations, engine_detail=memory.detail)


def _parts(b: MemoryBreakdown) -> str:
    names = ("params", "grads", "optimizer_states", "activations", "buffers", "reserve")
    return " + ".join(f"{name} {format_bytes(getattr(b, name))}" for name in names)


def _changed(plan: ResolvedPlan, change: dict) -> ResolvedPlan:
    """``plan`` with ``change`` applied; a dotted key (``fsdp.hybrid``) changes a nested setting."""
    fields: dict[str, object] = {}
    for key, value in change.items():
        head, _, tail = key.partition(".")
        if tail:
            fields[head] = dataclasses.replace(fields.get(head, getattr(plan, head)), **{tail: value})
        else:
            fields[key] = value
    return dataclasses.replace(plan, **fields)


def suggest_fixes(plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe,
                  limit: int = 3) -> list[str]:
    """Single changes (then pairs) that make the plan fit, cheapest first; never one the model
    cannot take (activation checkpointing of a model with nothing to checkpoint)."""
    singles = engine_spec(plan.engine).fixes(plan)
    if not supports_activation_checkpointing(probe.sample):
        singles = [(what, change) for what, change in singles if "activation_checkpointing" not in change]
    elif selective_problem(probe.sample):
        singles = [(what, change) for what, change in singles
                   if change.get("activation_checkpointing") != Recompute.selective]
    found: list[str] = []
    for what, change in singles:
        candidate = _changed(plan, change)
        if estimate_plan(candidate, cluster, optim, probe).feasible:
            found.append(what)
    if found:
        return found[:limit]
    for i, (what_a, change_a) in enumerate(singles):
        for what_b, change_b in singles[i + 1:]:
            merged = {**change_a, **change_b}
            if "zero_stage" in change_a and "zero_stage" in change_b:
                merged["zero_stage"] = max(change_a["zero_stage"], change_b["zero_stage"])
            candidate = _changed(plan, merged)
            if estimate_plan(candidate, cluster, optim, probe).feasible:
                found.append(f"{what_a}, and {what_b}")
                if len(found) >= limit:
                    return found
    return found


def check_plan(plan: ResolvedPlan, cluster: ClusterSpec, optim: OptimSpec, probe: ModelProbe) -> PlanEstimate:
    """Estimate the plan, name the attention kernel and the output head's layout it assumed and,
    when it does not fit, search for the changes that would."""
    estimate = dataclasses.replace(estimate_plan(plan, cluster, optim, probe), attention=probe.attention(plan),
                                   output_head=describe_head(plan, probe.output_head))
    if estimate.feasible:
        return estimate
    return dataclasses.replace(estimate, suggestions=suggest_fixes(plan, cluster, optim, probe))
