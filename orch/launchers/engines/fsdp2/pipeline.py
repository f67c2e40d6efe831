"""Pipeline parallelism in the fsdp2 engine (``plan.pp > 1``): torch's ``torch.distributed.pipelining``
schedules over this rank's stages (:mod:`orch.launchers.engines.fsdp2.pipeline_stages`).

Each stage is sharded by FSDP2 over the data-parallel ranks, block by block, and run by torch's
``PipelineStage``; the loss is the workload's objective on the last stage. A weight two stages
share (a tied embedding and output head) is a copy on each, whose gradients are summed across
the copies before the optimizer step. Evaluation runs each micro-batch through the stages in order.

With ``plan.cp > 1`` every stage runs on this rank's part of each sequence
(:class:`orch.launchers.engines.fsdp2.context.ContextSplit`): the micro-batches are cut before the
schedule takes them (inputs and targets alike), the pipeline layers that number tokens are told
their positions (``context_positions``), and attention spreads over the context-parallel ranks of
the same stage while the schedule runs. FSDP2 shards each stage over the data- and
context-parallel ranks together, as without stages.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from orch.launchers.engines.base import whole_tensor
from orch.launchers.engines.fsdp2.layout import loss_context
from orch.launchers.engines.fsdp2.pipeline_stages import (
    Stages,
    StateNames,
    block_class,
    cut,
    layer_of_module,
    whole_name_of_module,
)
from orch.plans.parallel.vocab_parallel import OutputHead
from orch.plans.spec import PipelineSchedule

if TYPE_CHECKING:
    from orch.launchers.engines.fsdp2.context import ContextSplit
    from orch.plans.parallel.sequence_parallel import SequenceParallelLayout
    from orch.plans.resolve import ResolvedPlan


def sync_tied_gradients(stages: Stages, groups: dict[str, Any]) -> None:
    """Sum each shared weight's gradient over its copies (on this rank, then over the pipeline
    ranks of ``groups[key]``) and give every copy the sum: what the one weight of the whole
    model gets. Copies are sharded alike over the data-parallel ranks, so local shards add up;
    a copy without a gradient (its stage never used it) takes part with zeros."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for key, copies in stages.tie_copies().items():
        for p in copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
        total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
        if groups.get(key) is not None:
            dist.all_reduce(total, group=groups[key])
        for grad in local:
            grad.copy_(total)


def tie_groups(stages: Stages, plan: ResolvedPlan, coords) -> dict[str, Any]:
    """For each tie key held on more than one pipeline rank, the process group of those ranks at
    this rank's data-, context- and tensor-parallel coordinates. Every rank creates every
    coordinate's group (as ``new_group`` requires), in the same order."""
    import itertools

    import torch.distributed as dist

    from orch.plans.parallel.rank_layout import global_rank

    mine: dict[str, Any] = {}
    for key, ranks in stages.tie_ranks().items():
        if len(ranks) < 2:
            continue
        for dp_rank, cp_rank, tp_rank in itertools.product(range(plan.dp), range(plan.cp), range(plan.tp)):
            members = [global_rank(dp_rank, r, tp_rank, tp=plan.tp, pp=plan.pp, cp_rank=cp_rank, cp=plan.cp)
                       for r in ranks]
            group = dist.new_group(members)
            if (dp_rank, cp_rank, tp_rank) == (coords.dp_rank, coords.cp_rank, coords.tp_rank):
                mine[key] = group
    return mine


def pipeline_schedule(stages: list[Any], plan: ResolvedPlan, loss_fn: Callable[[Any, Any], torch.Tensor]):
    """torch's schedule object for ``plan.pp_schedule`` over this rank's ``PipelineStage`` objects."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    kind = {PipelineSchedule.gpipe: ScheduleGPipe, PipelineSchedule.one_f_one_b: Schedule1F1B,
            PipelineSchedule.interleaved_1f1b: ScheduleInterleaved1F1B,
            PipelineSchedule.zero_bubble: ScheduleInterleavedZeroBubble,
            PipelineSchedule.zbv: ScheduleZBVZeroBubble}[plan.pp_schedule]
    m = plan.grad_accum_steps
    if plan.pp_schedule.interleaved:
        return kind(stages, n_microbatches=m, loss_fn=loss_fn)
    return kind(stages[0], n_microbatches=m, loss_fn=loss_fn)


def stage_input(batch: Any) -> torch.Tensor:
    """The first stage's input: a pipelined workload's batches are ``(inputs, targets, ...)``."""
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise TypeError(f"a pipelined model's batches are (inputs, targets) tuples, not {type(batch).__name__}: "
                    "the first stage takes the inputs, the objective on the last stage the whole batch")


def stage_target(batch: Any) -> torch.Tensor:
    """The last stage's targets: the second item of a pipelined workload's ``(inputs, targets)``."""
    if isinstance(batch, (list, tuple)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    raise TypeError("a pipelined model's batches are (inputs, targets) tuples: the objective on the last stage "
                    "takes the targets")


def draw(batches: Iterator[Any], count: int, to_device: Callable[[Any], Any]) -> list[Any]:
    """``count`` micro-batches from ``batches``, on this rank's device."""
    return [to_device(next(batches)) for _ in range(count)]


@dataclass
class Pipeline:
    """This rank's part of a pipelined fsdp2 run."""

    stages: Stages
    schedule: Any
    """torch's schedule over this rank's ``PipelineStage`` objects."""
    torch_stages: list[Any]
    """Those ``PipelineStage`` objects."""
    first: bool
    """This rank runs the first stage (it feeds the inputs)."""
    last: bool
    """This rank runs the last stage (it computes the loss)."""
    last_rank: int
    """The pipeline rank that runs the last stage (the losses come from it)."""
    pp_group: Any
    tied: dict[str, Any]
    """Process groups summing shared weights' gradients (:func:`tie_groups`)."""
    names: StateNames
    device: torch.device
    split_head: bool = False
    """The output head is split over the vocabulary (``plan.loss_parallel``): the last stage's logits
    are a DTensor, and each step and evaluation runs inside torch's ``loss_parallel``."""
    head: OutputHead | None = None
    """The split head (the whole model's names), where this rank holds a part of it (None elsewhere)."""
    context: ContextSplit | None = None
    """This rank's part of each sequence, with ``plan.cp > 1``."""

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """What the stages run inside: torch's ``loss_parallel`` when the head is split, attention
        spread over the context-parallel ranks with ``plan.cp > 1``."""
        with contextlib.ExitStack() as stack:
            if self.context is not None:
                stack.enter_context(self.context.attention())
            stack.enter_context(loss_context(self.split_head))
            yield

    @functools.cached_property
    def position_takers(self) -> list[torch.nn.Module]:
        """This rank's pipeline layers that number their tokens (``context_positions``)."""
        return self.stages.layers_with("context_positions")

    def local(self, batches: list[Any]) -> list[Any]:
        """``batches`` as this rank's stages take them: with ``plan.cp > 1`` each cut to the rank's
        part of the sequence, and the layers that number tokens told the parts' positions (one
        tensor for the sequence length: the schedule runs every micro-batch with the layers as set)."""
        if self.context is None:
            return batches
        parts = [self.context.local(batch) for batch in batches]
        for layer in self.position_takers:
            layer.context_positions = parts[-1][1]
        return [part for part, _ in parts]

    def mean(self, value: float) -> float:
        """A loss over this rank's tokens as the whole sequence's (the mean over the context-parallel ranks)."""
        return value if self.context is None else self.context.mean(value)


def build_pipeline(job, coords, device: torch.device, meshes, options: dict[str, Any]) -> Pipeline:
    """Build this rank's stages from the workload's pipeline layers (seeded per layer, so each
    starts as the whole model's layer does), then tensor parallelism (matched on the whole
    model's names), recomputation and compile of each block, FSDP2 over the data-parallel mesh
    (each block, then each stage) and torch's pipeline stages and schedule."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from orch.launchers.engines.fsdp2.layout import apply_tensor_parallel, enable_async_tp
    from orch.plans.parallel.vocab_parallel import output_head, splits_head

    plan = job.plan
    if job.workload.pipeline_layers is None:
        raise RuntimeError(f"plan.pp={plan.pp}: {job.workload.pipeline_refusal or 'the model has no pipeline layers'}")
    torch.manual_seed(job.train.seed)
    specs = job.workload.pipeline_layers()
    layout = cut(specs, plan)
    stages = Stages(specs, layout, coords.pp_rank)
    block = block_class(specs)
    blocks = [m for part in stages.parts.values() for m, spec in zip(part.layers, specs[part.start:part.stop],
                                                                      strict=True)
              if block is not None and spec.module is block]
    if plan.precision.value == "fp8":
        from orch.launchers.engines.fsdp2.float8 import convert_blocks_to_fp8

        convert_blocks_to_fp8(blocks, plan, device)
    split_head, held_heads, head = False, [], None
    if meshes.tp is not None:
        names = {name: whole_name_of_module(stages, name) for name, _ in stages.named_modules() if name}
        whole = _whole_on_meta(job)
        sequence = _stage_sequence_layout(stages, names, whole, job, plan.tp) if plan.sequence_parallel else None
        head = output_head(whole, job.workload.objective)
        split_head = splits_head(plan, head)
        if split_head:
            held_heads = held_parts_of_head(names, head)
        apply_tensor_parallel(stages, meshes.tp, job.workload.tp_layer_specs, match_names=names,
                              hf_plan=_hf_tp_plan(whole), sequence=sequence, heads=held_heads)
        if plan.async_tp:
            enable_async_tp(meshes.tp)
    context = None
    if meshes.cp is not None:
        from orch.launchers.engines.fsdp2.context import ContextSplit
        from orch.plans.parallel.stage_layers import declared

        if not declared(specs, "context_positions"):
            raise RuntimeError(f"plan.cp={plan.cp} with plan.pp={plan.pp}: the model's pipeline layers take no "
                               "positions of a part of the sequence (no context_positions attribute); set plan.cp=1")
        context = ContextSplit(meshes.cp)
    if plan.activation_checkpointing:
        from orch.plans.model.workload import checkpoint_blocks

        checkpoint_blocks(blocks, plan.activation_checkpointing, plan.recompute_every_n_layers)
    for module in blocks:
        if plan.compile:
            module.compile()
        fully_shard(module, **options)
    pipeline_stages = []
    for index, part in stages.parts.items():
        # Each stage is an FSDP root of its own; torch's split backward (the zero-bubble
        # schedules) needs the parameters the forward used, which plan.fsdp.reshard_after_forward=false
        # keeps (the planner requires it with them).
        fully_shard(part, **options)
        pipeline_stages.append(PipelineStage(part, int(index), layout.stages, device, group=meshes.pp.get_group()))
    objective = job.workload.objective

    def loss_fn(outputs, targets):
        # As DeepSpeed's pipeline: the last stage gets the batch's targets alone (torch infers the
        # gradients' shapes by running the loss on them, so they must be a tensor).
        return objective(outputs, (None, targets))

    schedule = pipeline_schedule(pipeline_stages, plan, loss_fn)
    return Pipeline(stages=stages, schedule=schedule, torch_stages=pipeline_stages, first=0 in stages.indices,
                    last=layout.stages - 1 in stages.indices, last_rank=layout.rank_of(layout.stages - 1),
                    pp_group=meshes.pp.get_group(), tied=tie_groups(stages, plan, coords), names=StateNames(stages),
                    device=device, split_head=split_head, head=head if held_heads else None, context=context)


def held_parts_of_head(names: dict[str, str], head: OutputHead) -> list[OutputHead]:
    """The parts of the split output ``head`` this rank's stages hold, under their own names
    (``names``: a stage module's name -> the whole model's). An untied head's layer is on the last
    stage. A tied head has a copy of its embedding on the first stage and on the last (pipeline
    layers sharing a weight, :class:`orch.plans.parallel.stage_layers.StageLayer`), each split
    alike, so that the copies' gradient shards add up; a copy is paired with the head layer it
    holds (a Hugging Face copy's linear head sharing the weight), or with none (the built-in GPT's
    copy computes the logits from the embedding's weight in its forward function)."""
    if head.embedding is None:
        return [OutputHead(name=name, classes=head.classes) for name, whole in names.items() if whole == head.name]
    held = []
    for name, whole in names.items():
        if whole == head.embedding:
            layer = layer_of_module(name)  # the copy's pipeline layer
            linear = next((other for other, whole_other in names.items()
                           if whole_other == head.name and other.startswith(f"{layer}.")), "")
            held.append(OutputHead(name=linear, classes=head.classes, embedding=name))
    return held


def _whole_on_meta(job) -> torch.nn.Module:
    """The whole model built on ``meta``, to read its tensor-parallel plan and layout off."""
    from orch.plans.model.meta import meta_device

    with meta_device():
        return job.workload.model_factory()


def _hf_tp_plan(whole: torch.nn.Module) -> dict | None:
    """The whole model's Hugging Face tensor-parallel plan, if it has one."""
    plan = getattr(whole, "_tp_plan", None)
    return plan if isinstance(plan, dict) and plan else None


def _stage_sequence_layout(stages: Stages, names: dict[str, str], whole: torch.nn.Module, job,
                           tp: int) -> SequenceParallelLayout:
    """Where sequence parallelism splits this rank's stages: the whole model's layout
    (:func:`orch.launchers.engines.fsdp2.layout.sequence_layout`) under the stages' names. Every
    pipeline layer holding blocks after the first is told its input arrives as one of ``tp``
    slices (``sequence_shards``: it computes positions and masks for the whole sequence); a model
    whose pipeline layers do not take that is refused, as the planner refuses it."""
    from orch.launchers.engines.fsdp2.layout import sequence_layout
    from orch.plans.parallel.sequence_parallel import stage_layout

    # A stage may hold stand-ins under a layer's name (the input embedding's copy of the base model
    # has an identity where the final norm was): only modules with parameters are the layer.
    held = {name: whole_name for name, whole_name in names.items()
            if next(stages.get_submodule(name).parameters(), None) is not None}
    layout = stage_layout(sequence_layout(whole, job.workload.tp_layer_specs), held)
    takers = stages.layers_with("sequence_shards")
    if not takers:
        raise RuntimeError("plan.sequence_parallel=true with plan.pp > 1: the model's pipeline layers do not take "
                           "a split sequence (no sequence_shards attribute); set plan.sequence_parallel=false")
    first = stages.get_submodule(layout.first_block) if layout.first_block else None
    for module in takers:
        if first is None or not any(sub is first for sub in module.modules()):
            module.sequence_shards = tp
    return layout


def train_step(pipeline: Pipeline, batches: Iterator[Any], micro: int, to_device) -> float:
    """One step's micro-batches through the schedule (forward, backward; gradients scaled by
    ``1 / micro`` as accumulation scales them), shared weights' gradients summed; returns the
    mean micro-batch loss, which the last stage computes and sends to its pipeline peers."""
    drawn = pipeline.local(draw(batches, micro, to_device))
    losses: list[torch.Tensor] = []
    with pipeline.running():
        pipeline.schedule.step(arg_mbs=[(stage_input(b),) for b in drawn],
                               target_mbs=[stage_target(b) for b in drawn], losses=losses,
                               # The last stage would keep every micro-batch's output (the logits) to
                               # return them merged: nothing here reads them.
                               return_outputs=False)
    drop_input_gradients(pipeline.torch_stages)
    sync_tied_gradients(pipeline.stages, pipeline.tied)
    return pipeline.mean(_mean_loss(pipeline, losses))


def drop_input_gradients(stages: list[Any]) -> None:
    """Free the gradients the schedule left on the stages' receive buffers.

    torch's split backward (``stage_backward_input``, which the zero-bubble schedules run) sets
    ``.grad`` on each received input and never clears it, where the full backward
    (``stage_backward``) does: the buffers live from step to step, so every stage after the first
    would hold one boundary activation's gradient per micro-batch between steps (measured: 4 MiB
    of the ZB-V ranks' held bytes in bench/results/memory_accuracy_pipeline.md), and add the next
    step's into it. Each gradient was sent upstream already, from the backward's own result.
    """
    for stage in stages:
        for infos in stage.args_recv_info.values():
            for info in infos:
                if isinstance(info.buffer, torch.Tensor):
                    info.buffer.grad = None


def _mean_loss(pipeline: Pipeline, losses: list[torch.Tensor]) -> float:
    """The mean of the last stage's ``losses``, on every rank of its pipeline group."""
    import torch.distributed as dist

    mean = torch.zeros((), device=pipeline.device)
    if pipeline.last:
        # From logits split over the vocabulary each loss is a replicated DTensor.
        mean = torch.stack([whole_tensor(loss).detach().float() for loss in losses]).mean().to(pipeline.device)
    dist.broadcast(mean, group=pipeline.pp_group, group_src=pipeline.last_rank)
    return float(mean)


def evaluate(pipeline: Pipeline, val_batches: Iterator[Any], batches: int, objective, to_device) -> dict[str, float]:
    """The held-out loss over ``batches`` micro-batches, each passed through the stages in order
    (:func:`forward_only`), the loss on the last stage. Not through the training schedule:
    evaluation needs no overlap, and torch's zero-bubble V schedule cannot run forward alone."""
    total = 0.0
    pipeline.stages.eval()
    try:
        with torch.no_grad(), pipeline.running():
            for _ in range(batches):
                [batch] = pipeline.local([to_device(next(val_batches))])
                out = forward_only(pipeline, stage_input(batch))
                loss = [objective(out, (None, stage_target(batch)))] if pipeline.last else []
                total += _mean_loss(pipeline, loss)
    finally:
        pipeline.stages.train()
    return {"loss": pipeline.mean(total / batches)}


_HEADER = 8
"""Integers describing an activation sent between stages: its dtype's index, its rank, its shape."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


def forward_only(pipeline: Pipeline, x: torch.Tensor) -> torch.Tensor | None:
    """One micro-batch through every stage in order: each rank runs its stages when their turn
    comes and sends the output to the next stage's rank (shape first, then the tensor). Returns
    the last stage's output on the rank running it, None elsewhere."""
    import torch.distributed as dist

    layout, group = pipeline.stages.layout, pipeline.pp_group
    me = dist.get_group_rank(group, dist.get_rank())
    for stage in range(layout.stages):
        owner = layout.rank_of(stage)
        before = layout.rank_of(stage - 1) if stage > 0 else owner
        if owner == me:
            if before != me:
                header = torch.zeros(_HEADER, dtype=torch.int64, device=pipeline.device)
                dist.recv(header, group=group, group_src=before)
                shape = [int(d) for d in header[2:2 + int(header[1])]]
                x = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=pipeline.device)
                dist.recv(x, group=group, group_src=before)
            x = pipeline.stages.parts[str(stage)](x)
        elif before == me:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=pipeline.device)
            header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
            header[2:2 + x.dim()] = torch.tensor(x.shape)
            dist.send(header, group=group, group_dst=owner)
            dist.send(x.contiguous(), group=group, group_dst=owner)
    return x if pipeline.last else None
