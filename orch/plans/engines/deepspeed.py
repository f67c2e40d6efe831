"""DeepSpeed as the planner knows it: ZeRO stages 0-3, CPU/NVMe offload, AutoTP and pipelines.

The rules quote DeepSpeed's own limits (each constant says where it asserts them); the memory of
a device is ZeRO's model states plus the step's phases (:mod:`orch.plans.memory.states`), stage by stage
for a pipeline; the step time is :func:`orch.plans.step_time.cost_model.predict_step`, which prices the
ZeRO stage's collectives. Its runtime is :class:`orch.launchers.engines.deepspeed.DeepSpeedEngine`.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from orch.plans.engine_settings import (
    ALLGATHER_BUCKET_SIZE,
    BUCKET_ALIGNMENT,
    REDUCE_BUCKET_SIZE,
    EngineSettings,
    ZeroStage,
)
from orch.plans.engines.base import Change, DeviceMemory, EngineSpec, declared_recompute, halve_micro_batch
from orch.plans.errors import Violation
from orch.plans.memory.build import GIB, BuildMemory
from orch.plans.spec import Accelerator, ClusterSpec, FSDPSpec, Offload, OptimizerName, PlanSpec, Precision, Recompute

if TYPE_CHECKING:
    from orch.plans.memory.activations import ActivationBytes
    from orch.plans.memory.estimate import ModelProbe
    from orch.plans.memory.states import ModelStats
    from orch.plans.parallel.pipeline import PipelineStage
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.search.space import SearchSpace

ZERO_STAGES = (0, 1, 2, 3)
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


class DeepSpeedSpec(EngineSpec):
    name = "deepspeed"
    runtime = "orch.launchers.engines.deepspeed:DeepSpeedEngine"
    summary = "DeepSpeed: ZeRO stages 0-3 (plan.zero_stage), CPU/NVMe offload, AutoTP tensor parallelism, pipelines"
    buffers_label = "DeepSpeed buffers"
    tracked_settings = ("zero_stage",)
    resume_keeps = ("tp", "pp", "zero_stage")
    stages_recompute_every_n = False  # PipelineModule's activation_checkpoint_interval: every layer

    def violations(self, plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
        v = super().violations(plan, cluster)
        if problem := _selective_with_autotp(plan):
            v.append(Violation("plan.activation_checkpointing", "selective", problem,
                               "set plan.activation_checkpointing=full, or plan.engine=fsdp2 (whose DTensor "
                               "tensor parallelism recomputes selectively)"))
        if plan.zero_stage not in ZERO_STAGES:
            v.append(Violation("plan.zero_stage", plan.zero_stage, "ZeRO stages are 0, 1, 2 and 3.",
                               "set plan.zero_stage to 0, 1, 2 or 3"))
        elif plan.tp > 1 and plan.zero_stage not in TP_ZERO_STAGES:
            v.append(Violation("plan.zero_stage", plan.zero_stage,
                               f"DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO stages "
                               f"{', '.join(map(str, TP_ZERO_STAGES))} only, not stage {plan.zero_stage} "
                               f"(plan.tp={plan.tp}).",
                               f"set plan.zero_stage={max(TP_ZERO_STAGES)}, or plan.tp=1 to keep "
                               f"ZeRO-{plan.zero_stage}"))
        if plan.pp > 1 and plan.zero_stage in (2, 3):
            v.append(Violation("plan.zero_stage", plan.zero_stage,
                               f"DeepSpeed's pipeline engine trains with ZeRO stages "
                               f"{', '.join(map(str, PP_ZERO_STAGES))} only, not stage {plan.zero_stage} "
                               f"(plan.pp={plan.pp}): it partitions gradients itself, stage by stage.",
                               f"set plan.zero_stage={max(PP_ZERO_STAGES)}, or plan.pp=1 to keep "
                               f"ZeRO-{plan.zero_stage}"))
        v += partition_violations(plan, "is not a partition method of DeepSpeed's PipelineModule.")
        return v + _offload_violations(plan, cluster)

    def rejection(self, plan: PlanSpec) -> str | None:
        if problem := super().rejection(plan):
            return problem
        if _selective_with_autotp(plan):
            return "selective recomputation with tp > 1 (AutoTP reduces in place)"
        if plan.tp > 1 and plan.zero_stage not in TP_ZERO_STAGES:
            return f"ZeRO-{plan.zero_stage} with tp > 1 (AutoTP trains with ZeRO {', '.join(map(str, TP_ZERO_STAGES))})"
        if plan.pp > 1 and plan.zero_stage not in PP_ZERO_STAGES:
            return f"ZeRO-{plan.zero_stage} with pp > 1 (the pipeline engine trains with ZeRO 0-1)"
        if plan.pp > 1 and plan.offload_param != Offload.none:
            return "parameter offload with pp > 1"
        return None

    def resume_problem(self, saved, plan) -> str | None:
        if problem := super().resume_problem(saved, plan):
            return problem
        if "dp" in saved and saved["dp"] != plan.dp and min(int(saved.get("zero_stage", 0)), plan.zero_stage) < 1:
            return "a ZeRO-0 checkpoint resumes at the same dp (a universal checkpoint needs ZeRO 1-3)"
        return None

    def elastic_violations(self, plan: PlanSpec) -> list[Violation]:
        if plan.zero_stage >= 1:
            return []
        return [Violation("plan.zero_stage", plan.zero_stage,
                          "train.elastic.enabled=true resumes the last checkpoint on fewer devices, at a smaller dp, "
                          "through a universal checkpoint, which DeepSpeed builds from ZeRO optimizer states; ZeRO-0 "
                          "writes none.",
                          "set plan.zero_stage=1 (which also shards the optimizer states), or "
                          "train.elastic.enabled=false")]

    def short_settings(self, plan: ResolvedPlan) -> str:
        return f"zero={plan.zero_stage}"

    def run_label(self, params: dict[str, str]) -> str:
        return f"z{params.get('plan.zero_stage', '?')}"

    def settings(self, plan: ResolvedPlan, optim, param_count: int | None = None) -> EngineSettings:
        """DeepSpeed's buffers capped at the model's size: it allocates its reduce bucket at full
        size (500M elements = 2 GB in fp32) whatever the model, which a small model never fills.
        The cap is rounded up to a multiple of :data:`BUCKET_ALIGNMENT`: ZeRO-2 refuses a bucket
        that is not a multiple of its alignment factor (2 to 8 elements, by dtype and world size)."""
        cap = -(-param_count // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT if param_count else REDUCE_BUCKET_SIZE
        gpu = plan.accelerator == Accelerator.gpu
        adam = optim.name in (OptimizerName.adam, OptimizerName.adamw)
        return EngineSettings(
            zero_stage=ZeroStage(plan.zero_stage),
            reduce_bucket_size=min(REDUCE_BUCKET_SIZE, cap),
            allgather_bucket_size=min(ALLGATHER_BUCKET_SIZE, cap),
            # On GPU the overlap hides NCCL time behind backward; on CPU (gloo) there is nothing to hide.
            overlap_comm=gpu,
            offload_optimizer=plan.offload_optimizer,
            offload_param=plan.offload_param,
            nvme_path=plan.nvme_path,
            pin_memory=gpu,
            # Without offload on CPU workers, torch's Adam avoids JIT-building DeepSpeed's FusedAdam,
            # which needs CUDA; with offload DeepSpeed picks its CPU Adam itself.
            torch_adam=adam and not gpu and plan.offload_optimizer == Offload.none,
            # ZeRO-3 fetches and releases parameters in hooks on every module.
            module_hooks=plan.zero_stage == ZeroStage.parameters,
        )

    def device_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, optim, probe: ModelProbe,
                      engine: EngineSettings, activations: ActivationBytes) -> DeviceMemory:
        """ZeRO's model states and the step's phases; with pipeline stages every stage on its own
        (its layers' parameters, its share of the activations times the micro-batches it holds in
        flight), gradients counted as accumulating, since 1F1B runs later forwards while earlier
        micro-batches' gradients sit in ``.grad``."""
        from orch.plans.parallel.pipeline import stage_activations

        if plan.pp <= 1:
            return DeviceMemory(per_stage=[_device_phases(plan, optim, engine, probe, probe.stats_for(plan.tp),
                                                          activations, plan.grad_accum_steps)])
        pipeline = probe.stages(plan)
        layers = probe.pipeline_layer_facts(plan)
        total_saved = sum(layer.saved_bytes for layer in layers)
        # Each layer's split parameters, matched by the whole model's names as AutoTP's patterns
        # match the stage's; models whose layers say nothing of it: the model's proportion.
        per_layer = plan.tp > 1 and any(layer.tp_params for layer in layers)
        per_stage = []
        for stage in pipeline:
            stats = _layer_stats(probe, stage, plan.tp) if per_layer else _stage_stats(probe, stage, plan.tp)
            states, phases = _device_phases(plan, optim, engine, probe, stats,
                                            stage_activations(activations, stage, total_saved,
                                                              holds_loss=stage.index == len(pipeline) - 1),
                                            max(plan.grad_accum_steps, 2))
            # Each tensor-parallel rank's receive buffers hold its part of a partitioned boundary tensor.
            boundary = stage.boundary_buffer_bytes
            buffers = stage.buffer_bytes - boundary + -(-boundary // plan.tp)
            held = dataclasses.replace(phases.held, buffers=phases.held.buffers + buffers)
            per_stage.append((states, dataclasses.replace(phases, held=held)))
        return DeviceMemory(per_stage=per_stage, pipeline=pipeline)

    def build_memory(self, plan: ResolvedPlan, cluster: ClusterSpec, *, built_bytes: int, param_count: int,
                     stages: list[PipelineStage], weight_file_bytes: int) -> BuildMemory:
        """A pipeline stage builds only its layers; ZeRO-3 without tensor parallelism builds inside
        ``deepspeed.zero.Init``, each worker holding its share; otherwise each builds it whole."""
        if plan.pp > 1:
            per_param = built_bytes / param_count if param_count else 0
            model, how = round(max(stage.params for stage in stages) * per_param), "pipeline stage"
        elif plan.zero_stage == 3 and plan.tp == 1:
            model, how = -(-built_bytes // plan.dp), "zero.Init share"
        else:
            return super().build_memory(plan, cluster, built_bytes=built_bytes, param_count=param_count,
                                        stages=stages, weight_file_bytes=weight_file_bytes)
        return BuildMemory(model=model, weights=weight_file_bytes, workers=min(cluster.devices_per_node,
                                                                                plan.world_size),
                           how=how, capacity=int(cluster.host_memory_gib * GIB))

    def fixes(self, plan: ResolvedPlan) -> list[Change]:
        changes = super().fixes(plan)
        if plan.pp == 1:
            changes += [(f"raise plan.zero_stage to {stage}", {"zero_stage": stage})
                        for stage in range(plan.zero_stage + 1, 4)]
        changes += halve_micro_batch(plan)
        if plan.offload_optimizer == Offload.none and plan.pp == 1:
            stage = max(plan.zero_stage, 1)
            what = "set plan.offload_optimizer=cpu" + (f" with plan.zero_stage={stage}"
                                                       if stage != plan.zero_stage else "")
            changes.append((what, {"offload_optimizer": Offload.cpu, "zero_stage": stage}))
        if plan.offload_param == Offload.none and plan.pp == 1:
            changes.append(("set plan.offload_param=cpu and plan.offload_optimizer=cpu with plan.zero_stage=3",
                            {"offload_param": Offload.cpu, "offload_optimizer": Offload.cpu, "zero_stage": 3}))
        return changes

    def search_settings(self, space: SearchSpace, pp: int) -> list[tuple[int, FSDPSpec]]:
        return [(stage, FSDPSpec()) for stage in space.zero_stages]

    def offloads(self, space: SearchSpace, zero_stage: int) -> list[tuple[Offload, Offload]]:
        """Optimizer offload from ZeRO-1, parameter offload only at ZeRO-3."""
        return [(off_opt, off_param)
                for off_opt in (space.offload if zero_stage >= 1 else (Offload.none,))
                for off_param in (space.offload if zero_stage == 3 else (Offload.none,))]

    def pipeline_partition(self, layers: list[tuple[str, int]], pp: int, method: str) -> list[int]:
        """``PipelineModule._partition_layers``'s split (:mod:`orch.plans.engines.deepspeed_partition`)."""
        from orch.plans.engines.deepspeed_partition import partition_layers

        return partition_layers(layers, pp, method)

    def pipeline_layer_problem(self, layers: list) -> str | None:
        """DeepSpeed's ``LayerSpec`` takes an ``nn.Module`` class, not a function that builds one."""
        from torch import nn

        from orch.plans.parallel.stage_layers import StageLayer

        for index, layer in enumerate(layers):
            if isinstance(layer, StageLayer) and not (isinstance(layer.module, type)
                                                      and issubclass(layer.module, nn.Module)):
                return (f"layer {index} ({layer.name}) is built by a function, and DeepSpeed's pipeline builds "
                        "layers from nn.Module classes only")
        return None

    def whole_parameters(self, params: list) -> AbstractContextManager | None:
        """``deepspeed.zero.GatheredParameters`` of those ``zero.Init`` partitioned (they carry a ``ds_id``)."""
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return None
        import deepspeed

        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)


def _offload_violations(plan: PlanSpec, cluster: ClusterSpec) -> list[Violation]:
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


def _device_phases(plan: ResolvedPlan, optim, engine: EngineSettings, probe: ModelProbe, stats: ModelStats,
                   activations: ActivationBytes, grad_accum_steps: int):
    from orch.plans.memory.states import model_state_bytes, step_phases

    states = model_state_bytes(param_count=stats.param_count, trainable_count=stats.trainable_count,
                               zero_stage=plan.zero_stage, dp=plan.dp, precision=plan.precision,
                               optimizer=optim.name, momentum=optim.momentum,
                               offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param)
    phases = step_phases(engine, states=states, model=stats, activations=activations, dp=plan.dp,
                         precision=plan.precision, grad_accum_steps=grad_accum_steps,
                         accelerator=plan.accelerator, persistent_params=probe.persistent_params(engine))
    return states, phases


def _stage_stats(probe: ModelProbe, stage: PipelineStage, tp: int, *, head: int = 0,
                 holds_head: bool = False) -> ModelStats:
    """A stage's parameter counts; its tensor-parallel layers split tp ways, in the model's proportion.

    An output head split over the vocabulary (``head``: its parameters, fsdp2's ``plan.loss_parallel``)
    is outside that proportion: its rows / tp count on the stage that ``holds_head`` alone.
    """
    from orch.plans.memory.states import ModelStats

    keep, keep_trainable = _tp_keep(probe, tp, head)
    mine, kept = (head, -(-head // tp)) if holds_head else (0, 0)
    return ModelStats(param_count=round((stage.params - mine) * keep) + kept,
                      trainable_count=round((stage.trainable - mine) * keep_trainable) + kept,
                      largest_layer_params=min(probe.stats.largest_layer_params, stage.params),
                      largest_param=stage.largest_param)


def kept_params(params: int, split: int, tp: int) -> int:
    """Of ``params`` parameters of which tensor parallelism splits ``split``, what one of ``tp`` ranks holds."""
    return params - split + -(-split // tp)


def _layer_stats(probe: ModelProbe, stage: PipelineStage, tp: int) -> ModelStats:
    """A stage's parameter counts, each of its layers' tensor-parallel split parameters
    (:attr:`orch.plans.parallel.pipeline.PipelineStage.tp_params`) held 1/tp."""
    from orch.plans.memory.states import ModelStats

    return ModelStats(param_count=kept_params(stage.params, stage.tp_params, tp),
                      trainable_count=kept_params(stage.trainable, stage.tp_trainable, tp),
                      largest_layer_params=min(probe.stats.largest_layer_params, stage.params),
                      largest_param=stage.largest_param)


def _tp_keep(probe: ModelProbe, tp: int, head: int = 0) -> tuple[float, float]:
    """The shares of the (all, trainable) parameters outside a split head of ``head`` parameters
    that one tensor-parallel rank keeps, over the whole model."""
    whole, sharded = probe.stats, probe.stats_for(tp)
    kept = -(-head // tp)
    rest, rest_trainable = whole.param_count - head, whole.trainable_count - head
    return ((sharded.param_count - kept) / rest if rest > 0 else 1.0,
            (sharded.trainable_count - kept) / rest_trainable if rest_trainable > 0 else 1.0)


SPEC = DeepSpeedSpec()


def partition_violations(plan: PlanSpec, message: str) -> list[Violation]:
    """``plan.pp_partition`` refused with ``message`` unless it is a method of DeepSpeed's
    ``PipelineModule`` (both engines cut stages with it)."""
    method = plan.pp_partition
    if method in PP_PARTITIONS or (method.startswith("type:") and len(method) > len("type:")):
        return []
    return [Violation("plan.pp_partition", method, message,
                      "set plan.pp_partition to parameters, uniform or type:REGEX (e.g. type:Block)")]


def _selective_with_autotp(plan: PlanSpec) -> str | None:
    """Why DeepSpeed cannot recompute ``plan`` selectively, or None. AutoTP all-reduces a
    row-parallel layer's matmul output in place; selective recomputation keeps that output and
    runs the all-reduce again in backward, on the kept (already reduced) tensor: measured, the
    losses drift from the run without recomputation. DTensor's all-reduce returns a new tensor."""
    if declared_recompute(plan) == Recompute.selective and plan.tp > 1:
        return (f"DeepSpeed's tensor parallelism (AutoTP, plan.tp={plan.tp}) all-reduces each row-parallel output in "
                "place, and selective recomputation keeps that output, so backward would reduce it a second time.")
    return None

