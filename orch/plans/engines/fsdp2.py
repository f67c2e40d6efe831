"""PyTorch FSDP2 (``fully_shard``) as the planner knows it: parameters, gradients and optimizer
states always sharded over the data-parallel ranks, with or without resharding after forward,
optionally hybrid (HSDP); host offload of everything or nothing; DTensor tensor parallelism, context
parallelism and torch's pipeline schedules.

Its memory is counted part by part as ``fully_shard`` lays it out
(:mod:`orch.plans.engines.fsdp2_memory`), its data-parallel time as FSDP2 moves it
(:mod:`orch.plans.engines.fsdp2_time`). Its runtime is :class:`orch.launchers.engines.fsdp2.FSDP2Engine`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from orch.plans.engine_settings import EngineSettings, ZeroStage
from orch.plans.engines.base import (
    Change,
    DeviceMemory,
    EngineSpec,
    _schedule_name,
    halve_micro_batch,
    schema_default,
)
from orch.plans.errors import Violation
from orch.plans.memory.build import GIB, BuildMemory
from orch.plans.spec import (
    Accelerator,
    ClusterSpec,
    FSDPSpec,
    Offload,
    OptimizerName,
    PlanSpec,
    Precision,
)

if TYPE_CHECKING:
    from orch.plans.engines.fsdp2_memory import FSDPMemory, FSDPMesh, FSDPUnits
    from orch.plans.memory.activations import ActivationBytes
    from orch.plans.memory.estimate import ModelProbe
    from orch.plans.memory.states import DevicePhases, ModelStateBytes, ModelStats
    from orch.plans.parallel.pipeline import PipelineStage
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.search.space import SearchSpace
    from orch.plans.step_time.cost_model import ModelCost, Speeds, StepTime


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RankInputs:
    """All that one pipeline rank's FSDP2 memory depends on (:func:`_rank_memory`), and nothing that
    tells otherwise equal ranks apart: ``rank`` is its stages as one with its position cleared."""

    rank: PipelineStage
    units: FSDPUnits
    stats: ModelStats
    holds_loss: bool
    engine: EngineSettings
    mesh: FSDPMesh
    activations: ActivationBytes
    total_saved: int
    """Saved bytes of one micro-batch through every layer: the stages' shares are of this."""
    held_output: int
    """The last layer's output, which torch's pipeline stage keeps through its backward."""
    split_backward: bool
    precision: Precision
    optimizer: OptimizerName
    momentum: float
    micro_batches: int


@functools.lru_cache(maxsize=1024)
def _rank_memory(inputs: _RankInputs) -> tuple[ModelStateBytes, DevicePhases, FSDPMemory]:
    """One pipeline rank's model states, phases (its pipeline buffers held) and FSDP2 parts.

    Cached: most ranks of a pipelined plan equal another of its ranks, and plans that differ only
    where memory does not look (compile, async TP) follow each other in the tuner's search, which
    counts hundreds of thousands of ranks for a 405B model; the results are shared, not copied,
    and never changed. The search visits equal ranks close together, so a small cache holds them."""
    from orch.plans.engines.fsdp2_memory import fsdp_memory
    from orch.plans.parallel.pipeline import stage_activations

    rank = inputs.rank

    def counted(stage: PipelineStage, *, earlier_grads: bool) -> FSDPMemory:
        acts = stage_activations(inputs.activations, stage, inputs.total_saved, holds_loss=inputs.holds_loss,
                                 held_output=inputs.held_output, split_backward=inputs.split_backward)
        return fsdp_memory(inputs.engine, mesh=inputs.mesh, model=inputs.stats, units=inputs.units,
                           activations=acts, precision=inputs.precision, optimizer=inputs.optimizer,
                           momentum=inputs.momentum, grad_accum_steps=2 if earlier_grads else 1)

    if inputs.micro_batches > rank.in_flight:
        fsdp = counted(rank, earlier_grads=True)
    else:
        # Every micro-batch's forward runs before the first backward: the activations of all
        # of them meet no gradients yet, and once the first backward has made some, fewer
        # micro-batches wait. Each phase at the larger of the two moments: all in flight
        # without gradients, or the last micro-batch alone with the others' gradients.
        alone = dataclasses.replace(rank, in_flight=1, in_flight_bytes=round(rank.in_flight_bytes / rank.in_flight),
                                    split_backward_bytes=0)
        waiting = counted(rank, earlier_grads=False)
        last = counted(alone, earlier_grads=True)
        fsdp = dataclasses.replace(waiting, phases=[max(a, b, key=lambda p: p.total)
                                                    for a, b in zip(waiting.phases, last.phases, strict=True)])
    phases = fsdp.device_phases()
    held = dataclasses.replace(phases.held, buffers=phases.held.buffers + rank.buffer_bytes)
    return fsdp.states, dataclasses.replace(phases, held=held), fsdp


class FSDP2Spec(EngineSpec):
    name = "fsdp2"
    runtime = "orch.launchers.engines.fsdp2:FSDP2Engine"
    summary = ("PyTorch FSDP2: fully_shard over the data-parallel ranks (plan.fsdp.reshard_after_forward, "
               "plan.fsdp.hybrid), host offload, DTensor tensor parallelism")
    buffers_label = "FSDP2 buffers"
    tracked_settings = ("fsdp.reshard_after_forward", "fsdp.hybrid")
    splits_fused_tp_layers = False
    resume_keeps = ()
    """DCP reshards on load, and pipeline stages save under the whole model's names: a checkpoint
    resumes at any dp, tp and pp."""
    compiles = True
    sequence_parallel = True
    async_tp = True
    fp8 = True
    context_parallel = True
    loss_parallel = True
    reads_fsdp_settings = True
    pipeline_schedules = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv")

    def violations(self, plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
        """What PyTorch FSDP2 cannot train, or orch's FSDP2 engine does not run."""
        from orch.plans.engines.deepspeed import partition_violations

        found = super().violations(plan, cluster)
        if plan.pp > 1:
            found += partition_violations(
                plan, "is not a partition method (DeepSpeed's PipelineModule's, which both engines use).")
        schedule = _schedule_name(plan.pp_schedule)
        if plan.pp > 1 and schedule in self.pipeline_schedules:
            from orch.plans.parallel.schedules import torch_schedule_violations

            found += torch_schedule_violations(schedule, pp=plan.pp, micro_batches=plan.grad_accum_steps)
        if plan.pp > 1 and schedule in ("zero_bubble", "zbv") and plan.fsdp.reshard_after_forward:
            # Measured: with resharding, torch's weight-gradient pass (stage_backward_weight) leaves
            # every gradient of the last stage unset.
            found.append(Violation("plan.fsdp.reshard_after_forward", True,
                                   f"the {schedule} schedule computes the weights' gradients in a pass of its "
                                   "own, after the input's, from the parameters the forward used: FSDP2 must keep "
                                   "them gathered from forward to backward.",
                                   "set plan.fsdp.reshard_after_forward=false, or plan.pp_schedule=interleaved_1f1b"))
        if plan.cp > 1 and plan.fsdp.hybrid:
            found.append(Violation("plan.fsdp.hybrid", True,
                                   f"with plan.cp={plan.cp} FSDP2 shards over the data- and context-parallel ranks "
                                   "together; hybrid sharding of that pair is not built.",
                                   "set plan.fsdp.hybrid=false, or plan.cp=1"))
        default_stage = schema_default("zero_stage")
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
                                   "FSDP2 offloads to host memory only (its CPUOffloadPolicy); it has no NVMe "
                                   "offload.",
                                   "set plan.offload_optimizer=cpu and plan.offload_param=cpu, or "
                                   "plan.engine=deepspeed for NVMe offload"))
        cpu = [name for name, where in offloads.items() if where == Offload.cpu]
        if not nvme and len(cpu) == 1:
            other = next(name for name in offloads if name not in cpu)
            found.append(Violation(cpu[0], Offload.cpu.value,
                                   "FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states to "
                                   f"the host together, so it cannot offload one without the other ({other}=none).",
                                   f"set {other}=cpu as well, or {cpu[0]}=none"))
        return found

    def short_settings(self, plan: ResolvedPlan) -> str:
        return f"reshard={'on' if plan.fsdp.reshard_after_forward else 'off'}" + (" hybrid" if plan.fsdp.hybrid
                                                                                   else "")

    def short_offload(self, plan: ResolvedPlan) -> str:
        """Everything or nothing: one place names it."""
        return plan.offload_optimizer.value

    def settings(self, plan: ResolvedPlan, optim, param_count: int | None = None) -> EngineSettings:
        """What ZeRO-3 shards, and no buckets: FSDP2 all-gathers and reduce-scatters one block's
        parameters at a time (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
        foreach_all_gather and foreach_reduce); its optimizer is torch's own, stepping the sharded
        fp32 parameters."""
        gpu = plan.accelerator == Accelerator.gpu
        adam = optim.name in (OptimizerName.adam, OptimizerName.adamw)
        return EngineSettings(
            zero_stage=ZeroStage.parameters,
            reshard_after_forward=plan.fsdp.reshard_after_forward, hybrid=plan.fsdp.hybrid,
            overlap_comm=gpu, offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param,
            pin_memory=gpu, torch_adam=adam,
            # A loss scaler's step hands the fused kernel a scale it cannot take from sharded
            # gradients, so fp16 steps with the multi-tensor kernel.
            fused_adam=adam and plan.precision != Precision.fp16)

    def device_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, optim, probe: ModelProbe,
                      engine: EngineSettings, activations: ActivationBytes) -> DeviceMemory:
        from orch.plans.engines.fsdp2_memory import fsdp_memory, fsdp_mesh

        if plan.pp > 1:
            return self._pipeline_memory(plan, cluster, optim, probe, engine, activations)
        fsdp = fsdp_memory(engine, mesh=fsdp_mesh(plan, cluster.devices_per_node), model=probe.stats_for(plan.tp),
                           units=probe.fsdp_units(plan.tp), activations=activations, precision=plan.precision,
                           optimizer=optim.name, momentum=optim.momentum, grad_accum_steps=plan.grad_accum_steps)
        return DeviceMemory(per_stage=[(fsdp.states, fsdp.device_phases())], detail=fsdp)

    def _pipeline_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, optim, probe: ModelProbe,
                         engine: EngineSettings, activations: ActivationBytes) -> DeviceMemory:
        """Each pipeline rank's stages as FSDP2 shards them: its layers' parameters, the blocks among
        them as units and the rest as its stages' roots, and the activations of the micro-batches
        its schedule holds in flight (:func:`orch.plans.parallel.pipeline.rank_stages`)."""
        from collections import Counter

        from orch.plans.engines.deepspeed import _layer_stats, _stage_stats, _tp_keep, kept_params
        from orch.plans.engines.fsdp2_memory import FSDPUnits, fsdp_mesh
        from orch.plans.parallel.schedules import stages_of_rank

        layers = probe.pipeline_layer_facts(plan)
        split_backward = plan.pp_schedule.splits_backward
        mesh = fsdp_mesh(plan, cluster.devices_per_node)
        ranks = probe.pipeline_ranks(plan)
        total_saved = sum(layer.saved_bytes for layer in layers)
        counts = Counter(layer.name for layer in layers)
        block, repeats = counts.most_common(1)[0]
        whole_units = probe.fsdp_units(plan.tp)
        per_stage, details = [], []
        stages = probe.stages(plan)
        # The output head split over the vocabulary (plan.loss_parallel): its parameters, whole.
        head = probe.output_head_params if plan.tp > 1 and probe.splits_output_head else 0
        # Each layer's split parameters, as the engine matches a stage's layers by the whole
        # model's names; models whose layers say nothing of it: the model's proportion.
        per_layer = plan.tp > 1 and any(layer.tp_params for layer in layers)

        for rank in ranks:
            mine = [i for s in stages_of_rank(rank.index, plan.pp, plan.pp_virtual_stages, plan.pp_schedule)
                    for i in range(stages[s].start, stages[s].stop)]
            in_root = [i for i in mine if layers[i].name != block or repeats < 2]
            if per_layer:
                stats = _layer_stats(probe, rank, plan.tp)
                root = sum(kept_params(layers[i].params, layers[i].tp_params, plan.tp) for i in in_root)
            else:
                # The engine splits the head of the stage that holds the last layer (the head itself).
                holds_head = bool(head) and len(layers) - 1 in mine
                stats = _stage_stats(probe, rank, plan.tp, head=head, holds_head=holds_head)
                keep = _tp_keep(probe, plan.tp, head)[0] if head else (stats.param_count / rank.params
                                                                        if rank.params else 1.0)
                root = round(keep * sum(layers[i].params for i in in_root if not (holds_head and i == mine[-1])))
                if holds_head:
                    root += -(-head // plan.tp)
            root = min(root, stats.param_count)
            # The root's layers after the rank's last block make their gradients before the blocks' backward.
            last_block = max((i for i in mine if i not in in_root), default=-1)
            after = [i for i in in_root if i > last_block]
            before_blocks = (root if len(after) == len(in_root) else
                             round(root * sum(layers[i].trainable for i in after)
                                   / max(sum(layers[i].trainable for i in in_root), 1)))
            units = FSDPUnits(root=root, root_trainable=min(root, stats.trainable_count),
                              root_trainable_before_blocks=min(before_blocks, stats.trainable_count),
                              largest_block=min(whole_units.largest_block, stats.param_count - root),
                              largest_block_trainable=min(whole_units.largest_block_trainable,
                                                          stats.trainable_count - root),
                              blocks=stats.param_count - root)
            states, phases, fsdp = _rank_memory(_RankInputs(
                rank=dataclasses.replace(rank, index=0, start=0, stop=0, layers=()), units=units, stats=stats,
                holds_loss=len(layers) - 1 in mine, engine=engine, mesh=mesh, activations=activations,
                total_saved=total_saved, held_output=layers[-1].output_bytes, split_backward=split_backward,
                precision=plan.precision, optimizer=optim.name, momentum=optim.momentum,
                micro_batches=plan.grad_accum_steps))
            per_stage.append((states, phases))
            details.append(fsdp)
        worst = max(range(len(per_stage)), key=lambda i: per_stage[i][1].held.total + per_stage[i][1].binding.total)
        return DeviceMemory(per_stage=per_stage, pipeline=ranks, detail=details[worst])

    def build_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, *, built_bytes: int, param_count: int,
                     stages: list[PipelineStage], weight_file_bytes: int) -> BuildMemory:
        """One worker builds the model whole and the others on meta (it broadcasts the weights);
        with pipeline stages, each builds only its own stages' layers."""
        if plan.pp > 1:
            per_param = built_bytes / param_count if param_count else 0
            return BuildMemory(model=round(max(stage.params for stage in stages) * per_param),
                               weights=weight_file_bytes, workers=min(cluster.devices_per_node, plan.world_size),
                               how="pipeline stage", capacity=int(cluster.host_memory_gib * GIB))
        if plan.world_size <= 1:
            return super().build_memory(plan, cluster, built_bytes=built_bytes, param_count=param_count,
                                        stages=stages, weight_file_bytes=weight_file_bytes)
        return BuildMemory(model=built_bytes, weights=weight_file_bytes,
                           workers=min(cluster.devices_per_node, plan.world_size), builders=1, how="whole",
                           capacity=int(cluster.host_memory_gib * GIB))

    def fixes(self, plan: ResolvedPlan) -> list[Change]:
        """No ZeRO stage to raise, and offload of everything or nothing."""
        changes = super().fixes(plan)
        if not plan.fsdp.reshard_after_forward:
            changes.append(("set plan.fsdp.reshard_after_forward=true", {"fsdp.reshard_after_forward": True}))
        if plan.fsdp.hybrid:
            changes.append(("set plan.fsdp.hybrid=false (shard over every node)", {"fsdp.hybrid": False}))
        changes += halve_micro_batch(plan)
        if plan.offload_param == Offload.none:
            changes.append(("set plan.offload_param=cpu and plan.offload_optimizer=cpu",
                            {"offload_param": Offload.cpu, "offload_optimizer": Offload.cpu}))
        return changes

    def step_time(self, plan: ResolvedPlan, model: ModelCost, speeds: Speeds, *, devices_per_node: int,
                  optim, probe: ModelProbe | None = None) -> StepTime:
        """ZeRO-3's step with FSDP2's data-parallel term; the root unit (gathered once per
        micro-batch) read off the model when there is one."""
        from orch.plans.engines.fsdp2_time import predict_fsdp_step

        root = probe.fsdp_units(plan.tp).root if probe is not None else 0
        return predict_fsdp_step(plan, model, speeds, devices_per_node=devices_per_node, optim=optim,
                                 root_params=root)

    def pipeline_partition(self, layers: list[tuple[str, int]], pp: int, method: str) -> list[int]:
        """DeepSpeed's split (:mod:`orch.plans.engines.deepspeed_partition`, which imports no DeepSpeed),
        into ``pp`` stages (``plan.pp * plan.pp_virtual_stages``), so a model is cut alike under both engines."""
        from orch.plans.engines.deepspeed_partition import partition_layers

        return partition_layers(layers, pp, method)

    def rejection(self, plan: PlanSpec) -> str | None:
        if problem := super().rejection(plan):
            return problem
        if plan.pp > 1 and _schedule_name(plan.pp_schedule) in ("zero_bubble", "zbv") and \
                plan.fsdp.reshard_after_forward:
            return "a zero-bubble schedule with resharding after forward"
        if plan.pp > 1 and _schedule_name(plan.pp_schedule) == "1f1b" and plan.grad_accum_steps < plan.pp:
            return "torch's 1f1b with fewer micro-batches than stages"
        return None

    def search_settings(self, space: SearchSpace, pp: int) -> list[tuple[int, FSDPSpec]]:
        """The schema's ZeRO stage (FSDP2 reads none), resharding on and off (the zero-bubble
        schedules take only off: :meth:`rejection`)."""
        stage = schema_default("zero_stage")
        return [(stage, FSDPSpec(reshard_after_forward=r)) for r in space.reshard_after_forward]


SPEC = FSDP2Spec()
