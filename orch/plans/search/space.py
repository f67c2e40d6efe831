"""The tuner's search: every plan of a world size and global batch, pruned and ranked.

Pure (no Ray, no Hydra). The space is every factorization ``dp * tp * pp * cp`` of the world size, the
training engine (DeepSpeed's ZeRO stages, or FSDP2 with and without ``reshard_after_forward``),
optimizer and parameter offload, activation checkpointing and power-of-two micro-batches with the
gradient accumulation that reaches the global batch. FSDP2 plans are enumerated only where FSDP2
runs them: at the one ZeRO stage it has (it always shards everything), offloading everything to
the CPU or nothing; context-parallel degrees above 1 only with the engines that split the
sequence. Pruning runs cheapest first:

1. structural rules, by arithmetic on the plan (tp within a node and dividing the model's heads,
   pp at most the model's layers, what the pipeline and AutoTP engines train with);
2. :func:`orch.plans.resolve.resolve_plan`, the same validation ``orch train`` applies (whatever it
   refuses is counted under its own message, so rules added there prune here without changes);
3. the memory estimate (:func:`orch.plans.memory.estimate.estimate_plan`) against one :class:`ModelProbe`.

Survivors are ranked by the predicted step time (:mod:`orch.plans.step_time.cost_model`; FSDP2's data-parallel
term from :mod:`orch.plans.engines.fsdp2_time`). Every rejection is
counted by reason, so a user sees why a plan they expected is not there.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from orch.plans.engines import engine_spec
from orch.plans.errors import PlanError
from orch.plans.memory.activations import ActivationBytes, measure_activations, measure_activations_depth_scaled
from orch.plans.memory.estimate import ModelProbe, PlanEstimate, estimate_plan
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import batch_bytes
from orch.plans.parallel.pipeline import PipelineLayer, partition
from orch.plans.resolve import ResolvedPlan, divisors, resolve_plan
from orch.plans.spec import (
    Accelerator,
    ClusterSpec,
    FSDPSpec,
    Offload,
    OptimSpec,
    PipelineSchedule,
    PlanSpec,
    Precision,
    Recompute,
    TrainSpec,
)
from orch.plans.step_time.cost_model import ModelCost, Speeds, StepTime
from orch.plans.step_time.prediction import plan_step


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the tuner may vary; the precision and the global batch are the user's."""

    world_size: int
    global_batch_size: int
    precision: Precision = Precision.fp32
    tp: tuple[int, ...] | None = None
    """Tensor-parallel degrees to try; None: every divisor of the world size."""
    pp: tuple[int, ...] | None = None
    """Pipeline degrees to try; None: every divisor of the world size."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload: tuple[Offload, ...] = (Offload.none, Offload.cpu)
    """Where optimizer states and (with ZeRO-3) parameters may go."""
    activation_checkpointing: tuple[Recompute, ...] = (Recompute.none, Recompute.selective, Recompute.full)
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batches to try; None: the powers of two that divide the batch each replica gets."""
    engines: tuple[str, ...] = ("deepspeed",)
    """Training engines to try (``plan.engine`` values)."""
    reshard_after_forward: tuple[bool, ...] = (True, False)
    """FSDP2's ``plan.fsdp.reshard_after_forward`` values to try."""
    compile: tuple[bool, ...] = (False,)
    """``plan.compile`` values to try (true only with engines that compile)."""
    sequence_parallel: tuple[bool, ...] = (False,)
    """``plan.sequence_parallel`` values to try (true only with tp > 1, with engines that split the
    sequence)."""
    fp8: tuple[bool, ...] = (False,)
    """Whether to try ``plan.precision=fp8`` beside a declared bf16, with engines that train in it
    (the tuner leaves it out where the cluster declares no FP8 matmuls)."""
    async_tp: tuple[bool, ...] = (False,)
    """``plan.async_tp`` values to try (true only with tp > 1, sequence parallelism and compile, with
    engines that overlap them; the tuner leaves it false on clusters without GPUs)."""
    cp: tuple[int, ...] = (1,)
    """Context-parallel degrees to try (above 1 only with engines that split the sequence that way)."""
    pp_schedules: tuple[tuple[PipelineSchedule, int], ...] = ((PipelineSchedule.one_f_one_b, 1),)
    """(``plan.pp_schedule``, ``plan.pp_virtual_stages``) pairs to try with pp > 1, each with the
    engines that run the schedule."""
    recompute_every_n_layers: tuple[int, ...] = (1,)
    """``plan.recompute_every_n_layers`` values to try with each recomputation policy but none."""

    def plans(self) -> Iterator[PlanSpec]:
        """Every candidate, offload combinations limited to what each engine can express (ZeRO:
        parameter offload only at stage 3, optimizer offload from stage 1; FSDP2: both or none)."""
        for tp, pp, cp in itertools.product(self.tp or divisors(self.world_size),
                                            self.pp or divisors(self.world_size), self.cp):
            if self.world_size % (tp * pp * cp):
                continue
            dp = self.world_size // (tp * pp * cp)
            for micro in self._micro_batches(dp):
                accum = self.global_batch_size // (micro * dp)
                for engine, stage, fsdp in self._engine_settings(pp):
                    if cp > 1 and not engine_spec(engine).context_parallel:
                        continue
                    for off_opt, off_param in self._offloads(engine, stage):
                        for (ckpt, every), compiled, (schedule, virtual), sequence, precision in itertools.product(
                                self._recomputations(engine, pp), self._compiles(engine),
                                self._schedules(engine, pp), self._sequence_parallel(engine, tp),
                                self._precisions(engine)):
                            for overlapped in self._async_tps(engine, tp, sequence, compiled):
                                yield PlanSpec(engine=engine, fsdp=dataclasses.replace(fsdp), dp=dp, tp=tp, pp=pp,
                                               cp=cp, zero_stage=stage, offload_optimizer=off_opt,
                                               offload_param=off_param, activation_checkpointing=ckpt,
                                               recompute_every_n_layers=every,
                                               micro_batch_size=micro, grad_accum_steps=accum,
                                               precision=precision, compile=compiled,
                                               pp_schedule=schedule.value, pp_virtual_stages=virtual,
                                               sequence_parallel=sequence, async_tp=overlapped)

    def _recomputations(self, engine: str, pp: int) -> list[tuple[Recompute, int]]:
        """(policy, every n-th block) pairs to try: none once, each other policy at each n the
        engine's stages can take (every block only where they cannot)."""
        everies = self.recompute_every_n_layers if pp <= 1 or engine_spec(engine).stages_recompute_every_n else (1,)
        return [(policy, every) for policy in self.activation_checkpointing
                for every in (everies if policy else (1,))]

    def _schedules(self, engine: str, pp: int) -> list[tuple[PipelineSchedule, int]]:
        """(schedule, stages per rank) pairs to try with ``engine`` at ``pp``: the default alone
        without a pipeline, else those of :attr:`pp_schedules` the engine runs."""
        runs = engine_spec(engine).pipeline_schedules
        found = [(s, v) for s, v in self.pp_schedules if s.value in runs] if pp > 1 else []
        return found or [(PipelineSchedule.one_f_one_b, 1)]

    def _compiles(self, engine: str) -> tuple[bool, ...]:
        """``plan.compile`` values to try with ``engine``: false only where it does not compile."""
        return self.compile if engine_spec(engine).compiles else tuple(c for c in self.compile if not c) or (False,)

    def _sequence_parallel(self, engine: str, tp: int) -> tuple[bool, ...]:
        """``plan.sequence_parallel`` values to try: false only where the sequence cannot be split."""
        if tp > 1 and engine_spec(engine).sequence_parallel:
            return self.sequence_parallel
        return tuple(s for s in self.sequence_parallel if not s) or (False,)

    def _precisions(self, engine: str) -> tuple[Precision, ...]:
        """The declared precision, and fp8 beside a declared bf16 where :attr:`fp8` asks for it and
        ``engine`` trains in it."""
        if self.precision == Precision.bf16 and True in self.fp8 and engine_spec(engine).fp8:
            return (Precision.bf16, Precision.fp8) if False in self.fp8 else (Precision.fp8,)
        return (self.precision,)

    def _async_tps(self, engine: str, tp: int, sequence: bool, compiled: bool) -> tuple[bool, ...]:
        """``plan.async_tp`` values to try: false only where there are no sequence-parallel
        collectives of a compiled block to overlap."""
        if tp > 1 and sequence and compiled and engine_spec(engine).async_tp:
            return self.async_tp
        return tuple(a for a in self.async_tp if not a) or (False,)

    def _engine_settings(self, pp: int) -> list[tuple[str, int, FSDPSpec]]:
        """(engine, ZeRO stage, FSDP2 settings) to try at pipeline degree ``pp``, as each engine's
        spec lists its axes."""
        return [(engine, stage, fsdp) for engine in self.engines
                for stage, fsdp in engine_spec(engine).search_settings(self, pp)]

    def _micro_batches(self, dp: int) -> list[int]:
        if self.global_batch_size % dp:
            return []
        per_replica = self.global_batch_size // dp
        sizes = self.micro_batch_sizes or [2**i for i in range(per_replica.bit_length()) if 2**i <= per_replica]
        return [m for m in sizes if per_replica % m == 0]

    def _offloads(self, engine: str, stage: int) -> list[tuple[Offload, Offload]]:
        return engine_spec(engine).offloads(self, stage)


def structural_rejection(plan: PlanSpec, *, devices_per_node: int, n_layers: int,
                         tp_problem: Callable[[int], str | None]) -> str | None:
    """Why ``plan`` can never run on this model and cluster (arithmetic only), or None.

    ``tp_problem(tp)`` says why the model cannot be split ``tp`` ways (e.g. its heads do not
    divide), or None. The reasons are short and fixed, so they count well.
    """
    if devices_per_node % plan.tp:
        return "tp does not divide cluster.devices_per_node (a tensor-parallel group stays in one node)"
    if plan.tp > 1 and (problem := tp_problem(plan.tp)):
        return problem
    if plan.pp > max(n_layers, 1):
        return "pp exceeds the model's layers"
    return engine_spec(plan.engine).rejection(plan)


def plan_error_reason(error: PlanError) -> str:
    """A PlanError's first problem, without the numbers that would split one reason into many."""
    v = error.violations[0]
    return f"{v.field}: {v.message.split(' (')[0].split(':')[0].rstrip('.')}"


class BatchScaledProbe(ModelProbe):
    """A :class:`ModelProbe` that measures activations at small micro-batches and scales beyond.

    Measuring a 175B model's activations on ``meta`` takes seconds per micro-batch size; the
    tuner needs a dozen sizes. Up to ``exact_up_to`` the measurement is exact (on copies of the
    model built once, not rebuilt). Beyond, each component is extrapolated from the largest
    measured power of two m2: proportionally (``value(m2) * m / m2``) and, when m2 / 2 was
    measured too, affinely; the larger of the two is kept. The backward peak can move as the
    batch grows, so neither alone is safe; the larger errs towards not fitting
    (tests/test_tune_space.py measures how far).
    """

    def __init__(self, *args, exact_up_to: int = 2, depth_scaled: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.exact_up_to = max(exact_up_to, 1)
        self.depth_scaled = depth_scaled
        """Measure on copies cut to two shallow depths and extrapolate (orch.plans.model.depth_scaling)."""

    def _options(self) -> dict:
        return {"exact_up_to": self.exact_up_to, "depth_scaled": self.depth_scaled}

    def _measure(self, micro_batch_size: int, precision: Precision, checkpointing: bool,
                 tp: int = 1, accelerator: Accelerator = Accelerator.cpu,
                 sequence_parallel: bool = False, cp: int = 1) -> ActivationBytes:
        if tp > 1 and self.exact_up_to == 1 and not sequence_parallel:
            # A large model in a hurry: measuring every tensor-parallel shard on meta costs seconds
            # each; the unsharded activations are an upper bound (tp only divides them). Not with
            # sequence parallelism: dividing nearly all of them by tp is its point, and a plan
            # that needs it to fit would be dropped.
            return self._activations(micro_batch_size, precision, checkpointing, 1, accelerator, False, cp)
        if micro_batch_size <= self.exact_up_to:
            if tp > 1 or cp > 1 or self.shallow is not None:  # a shallow probe carries its counts in any case
                return super()._measure(micro_batch_size, precision, checkpointing, tp, accelerator,
                                        sequence_parallel, cp)
            measure = measure_activations_depth_scaled if self.depth_scaled else measure_activations
            return measure(self.module, micro_batch_size=micro_batch_size, inputs=self.inputs,
                           dtype=precision.dtype, checkpointing=checkpointing, accelerator=accelerator)
        m2 = 1 << (self.exact_up_to.bit_length() - 1)  # the largest power of two measured exactly
        high = self._activations(m2, precision, checkpointing, tp, accelerator, sequence_parallel, cp)
        low = (self._activations(m2 // 2, precision, checkpointing, tp, accelerator, sequence_parallel, cp)
               if m2 > 1 else None)

        def scale(name: str) -> int:
            b = getattr(high, name)
            # Parameter gradients held at the backward peak do not grow with the batch.
            fixed = high.grads_at_backward_peak if name == "backward_peak_with_grads" else 0
            proportional = fixed + (b - fixed) * micro_batch_size // m2
            if low is None:
                return proportional
            a = getattr(low, name)
            return max(proportional, b + (b - a) * (micro_batch_size - m2) // (m2 - m2 // 2))

        names = [f.name for f in dataclasses.fields(ActivationBytes)]
        values = {n: scale(n) for n in names if n != "grads_at_backward_peak"}
        return ActivationBytes(**values, grads_at_backward_peak=high.grads_at_backward_peak)

    def _measure_built(self, factory, **args) -> ActivationBytes:
        # A deep model's tensor- and context-parallel measurements are extrapolated from two
        # shallow copies too (of the sharded or split model: their hooks and shapes are copied).
        if not self.depth_scaled:
            return super()._measure_built(factory, **args)
        with meta_device():
            module = factory()
        return measure_activations_depth_scaled(module, **args)

    def _measure_pipeline(self, micro_batch_size: int, precision: Precision, tp: int = 1) -> list[PipelineLayer]:
        # A layer's saved tensors and its output all carry the batch dimension: proportional scaling
        # from one sample is exact up to constants like position indices, which it overstates slightly.
        if micro_batch_size == 1:
            return super()._measure_pipeline(1, precision, tp)
        return [dataclasses.replace(layer, saved_bytes=layer.saved_bytes * micro_batch_size,
                                    output_bytes=layer.output_bytes * micro_batch_size,
                                    weight_grad_bytes=layer.weight_grad_bytes * micro_batch_size)
                for layer in self._pipeline(1, precision, tp)]

    def _bounds(self, layers: list[PipelineLayer], precision: Precision, pp: int, method: str,
                engine: str) -> list[int]:
        # Stage boundaries depend on the layers' parameters only, and DeepSpeed's balanced
        # partition takes a quarter of a second for a 96-layer model: partition once per
        # (pp, method, engine); the stages' bytes (saved, in flight, the engines' buffers) are each
        # plan's, from its micro-batch's layers.
        return self._cut(precision, pp, method, engine)

    @functools.cache  # noqa: B019 - one probe per tuning, kept alive by it anyway
    def _cut(self, precision: Precision, pp: int, method: str, engine: str) -> list[int]:
        return partition(self._pipeline(1, precision), pp, method, engine)

    @staticmethod
    def _input_bytes(inputs, micro_batch_size: int) -> int:
        # The inputs' bytes grow with the batch: one sample's, times the micro-batch.
        return batch_bytes(inputs.example_batch(1)) * micro_batch_size


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A plan that passed validation, with its memory estimate and predicted step time."""

    plan: ResolvedPlan
    estimate: PlanEstimate
    predicted: StepTime

    @property
    def feasible(self) -> bool:
        return self.estimate.feasible


@dataclass(kw_only=True)
class SearchResult:
    ranked: list[Candidate]
    """Plans that fit, fastest predicted first."""
    infeasible: list[Candidate]
    """Plans that passed validation but do not fit in memory, fastest predicted first."""
    rejected: Counter = field(default_factory=Counter)
    """Reason -> how many plans it rejected (memory rejections included)."""
    enumerated: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def plan_layout(plan: ResolvedPlan) -> tuple:
    """Everything of a plan but its ZeRO stage (or FSDP2's resharding): engine, degrees,
    micro-batch, accumulation, checkpointing and offload. Plans of one layout differ only in how
    the data-parallel ranks share state; two engines are two layouts, since the cost model's error
    differs between their implementations more than between their stages."""
    return (plan.engine, plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.grad_accum_steps,
            plan.activation_checkpointing, plan.recompute_every_n_layers, plan.offload_optimizer, plan.offload_param,
            plan.compile, plan.pp_schedule, plan.pp_virtual_stages, plan.sequence_parallel, plan.async_tp, plan.cp)


def trial_candidates(ranked: list[Candidate], n: int) -> list[Candidate]:
    """The ``n`` plans to run as trials: the best predicted of each layout first, in predicted
    order, then the next best predicted.

    A layout is everything but the ZeRO stage (:func:`plan_layout`). Plans of one layout differ
    only in data-parallel communication and are predicted close together, while the model's
    error between layouts is larger. Measured on 4 CPU workers, the three best predictions were
    ZeRO 0/1/2 of one layout while the fastest plan was another layout, ranked fifth: three
    trials spent on one layout could not find it.
    """
    seen: set[tuple] = set()
    firsts, rest = [], []
    for candidate in ranked:
        layout = plan_layout(candidate.plan)
        (rest if layout in seen else firsts).append(candidate)
        seen.add(layout)
    return (firsts + rest)[:n]


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """Everything fixed during one search: the cluster, the loop, the model and the speeds."""

    cluster: ClusterSpec
    train: TrainSpec
    optim: OptimSpec
    probe: ModelProbe
    model_cost: ModelCost
    speeds: Speeds
    tp_problem: Callable[[int], str | None] = lambda tp: None
    """Why the model cannot be split ``tp`` ways, or None."""
    plan_problem: Callable[[ResolvedPlan], str | None] = lambda plan: None
    """Why the model cannot run a resolved plan (e.g. a pipeline stage without layers), or None."""


def search(space: SearchSpace, ctx: SearchContext) -> SearchResult:
    """Enumerate, prune (cheap rules first) and rank; see the module docstring."""
    started = time.perf_counter()
    result = SearchResult(ranked=[], infeasible=[])
    train = dataclasses.replace(ctx.train, global_batch_size=space.global_batch_size)
    for spec in space.plans():
        result.enumerated += 1
        reason = structural_rejection(spec, devices_per_node=ctx.cluster.devices_per_node,
                                      n_layers=ctx.model_cost.n_layers, tp_problem=ctx.tp_problem)
        if reason:
            result.rejected[reason] += 1
            continue
        try:
            plan = resolve_plan(spec, ctx.cluster, train)
        except PlanError as error:
            result.rejected[plan_error_reason(error)] += 1
            continue
        if problem := ctx.plan_problem(plan):
            result.rejected[problem] += 1
            continue
        try:
            estimate = estimate_plan(plan, ctx.cluster, ctx.optim, ctx.probe)
        except PlanError as error:  # the model refuses the plan's micro-batch
            result.rejected[plan_error_reason(error)] += 1
            continue
        predicted = plan_step(plan, ctx.model_cost, ctx.speeds, ctx.probe,
                              devices_per_node=ctx.cluster.devices_per_node, optim=ctx.optim)
        candidate = Candidate(plan=plan, estimate=estimate, predicted=predicted)
        if estimate.feasible:
            result.ranked.append(candidate)
        else:
            result.infeasible.append(candidate)
            result.rejected["does not fit: " + ", ".join(v.field for v in estimate.violations)] += 1
    # Ties (the declared speeds give every micro-batch the same matmul rate) go to fewer
    # micro-steps, then to less memory: each micro-step has fixed costs the model leaves out.
    def rank(c: Candidate) -> tuple:
        return (c.predicted.total_s, c.plan.grad_accum_steps, c.estimate.per_device.total)

    result.ranked.sort(key=rank)
    result.infeasible.sort(key=rank)
    result.seconds = time.perf_counter() - started
    return result


def plan_spec(plan: ResolvedPlan) -> PlanSpec:
    """The declarable plan (``orch/conf/plan/*.yaml``, ``orch train`` overrides) of a resolved one."""
    resolved = {f.name for f in dataclasses.fields(plan)}
    spec = PlanSpec(**{f.name: copy.copy(getattr(plan, f.name)) for f in dataclasses.fields(PlanSpec)
                       if f.name in resolved})
    spec.pp_schedule = plan.pp_schedule.value  # declared as its name
    return spec
