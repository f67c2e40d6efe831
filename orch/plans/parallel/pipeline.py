"""Pipeline stages of a plan: which layers each stage gets, what they hold, and the bubble.

The layers are the model's own pipeline layers (:class:`orch.plans.parallel.stage_layers.StageLayer`
objects, or DeepSpeed ``LayerSpec`` ones; see orch/workloads/gpt.py), built one at a time on
``meta``: the split is computed with DeepSpeed's own partition functions on the same weights
``PipelineModule`` uses, so every stage here is the stage
a worker will build. Activations are measured per layer by running the layers in order on
``meta``, as the stages will, with the loss on the last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from orch.plans.memory.activations import ActivationBytes, _MetaRunsAsOnCpu, _SavedTensors
from orch.plans.model.depth_scaling import SHALLOW_DEPTHS
from orch.plans.model.meta import meta_device
from orch.plans.model.workload import ModelInputs, move_batch


@dataclass(frozen=True, kw_only=True)
class PipelineLayer:
    """One layer of the pipeline, measured on ``meta``."""

    name: str
    """The layer's class name (what ``type:REGEX`` partitions match)."""
    params: int
    trainable: int
    """Parameters with ``requires_grad``: DeepSpeed balances stages by these."""
    largest_param: int
    saved_bytes: int
    """Bytes autograd saves in this layer for one micro-batch (the loss's go to the last layer)."""
    output_bytes: int = 0
    """Bytes of the layer's output for one micro-batch: what a stage ending here sends on."""
    tp_params: int = 0
    """Its parameters the tensor-parallel layer specs split (matched by the whole model's names)."""
    tp_trainable: int = 0
    """The same, with ``requires_grad``."""
    weight_grad_bytes: int = 0
    """Bytes of the outputs of the layer's calls where a trainable weight meets the layer's input
    (a linear's, a norm's, a tied head's logits), for one micro-batch: their gradients are what a
    schedule that splits backward keeps between a micro-batch's input backward and its weight
    backward (torch's ``stage_backward_input`` keeps the gradient arriving at each node where a
    weight's gradient parts from the input's, to start the weight pass from)."""


@dataclass(frozen=True, kw_only=True)
class PipelineStage:
    """The layers ``[start, stop)`` one stage runs and what they add up to."""

    index: int
    start: int
    stop: int
    layers: tuple[str, ...]
    params: int
    trainable: int
    largest_param: int
    saved_bytes: int
    """Saved activations of one micro-batch in this stage."""
    tp_params: int = 0
    """Its layers' parameters the tensor-parallel layer specs split (:attr:`PipelineLayer.tp_params`)."""
    tp_trainable: int = 0
    """The same, with ``requires_grad``."""
    in_flight: float
    """Micro-batches whose activations the stage holds at once under DeepSpeed's 1F1B schedule:
    ``min(pp - stage, micro-batches)`` (``TrainSchedule.num_pipe_buffers``); the first stage holds most."""
    buffer_bytes: int = 0
    """The pipeline engine's buffers kept from one step to the next (runtime/pipe/engine.py): the
    receive buffer of a stage after the first (``pipe_recv_buf``, one input) and the
    received-gradient buffer of a stage before the last (``grad_layer``, one output); the first
    stage also keeps its slots of token ids (``pipe_buffers['inputs']``), the last its slots of
    outputs, the logits (``pipe_buffers['outputs']``), each with its received input and that
    input's gradient, which the logits' autograd graph still references."""
    boundary_buffer_bytes: int = 0
    """The part of ``buffer_bytes`` that holds a boundary activation or gradient as it arrives
    (``pipe_recv_buf``, ``grad_layer``): with tp > 1 DeepSpeed sends those partitioned over the
    tensor-parallel ranks (``pipe_partitioned``, ``grad_partitioned``), and each rank's buffer holds
    its 1/tp; the full tensor it gathers is a transient."""
    in_flight_bytes: int = 0
    """Inputs and outputs of the micro-batches in flight, held during the step: an output lives
    until its backward, a received input until its gradient is sent back."""
    split_backward_bytes: int = 0
    """With a schedule that splits backward (``zbv``, ``zero_bubble``), what the rank holds at its
    fullest input backward above ``in_flight`` micro-batches through all its layers: the output
    gradients kept for the weight backwards it defers into the drain, beside the activations those
    micro-batches still hold, and its chunks' activations counted chunk by chunk
    (:func:`orch.plans.parallel.schedules.split_backward_moments`)."""


def _build(spec) -> torch.nn.Module:
    with meta_device():
        return spec.build() if hasattr(spec, "build") else spec


def _run(spec, module: torch.nn.Module, x):
    forward_fn = getattr(spec, "forward_fn", None)
    return forward_fn(module, x) if forward_fn is not None else module(x)


def measure_pipeline_layers(specs: list, *, micro_batch_size: int, inputs: ModelInputs,
                            dtype: torch.dtype, tp_layer_specs: list[dict] | None = None,
                            tp: int = 1) -> list[PipelineLayer]:
    """Parameters and saved activations of every pipeline layer, on ``meta``, in order.

    The first layer takes the batch's inputs and the last layer's output goes through the
    objective with the batch's targets, as DeepSpeed's pipeline engine feeds an ``(inputs,
    targets)`` batch through the stages and its ``loss_fn``. The parameters ``tp_layer_specs``
    split are counted per layer by the whole model's names (:attr:`StageLayer.names`), as the
    fsdp2 engine matches a stage's layers.

    With ``tp > 1`` the saved and output bytes are one tensor-parallel rank's: each layer is
    sharded by the same names before it runs (the loss, under
    :func:`orch.plans.parallel.split_loss.split_loss_on_meta` where the caller splits the head,
    then runs on the rank's part of the logits), so that a stage's share of the saved bytes is
    its share of what the whole model, measured sharded, saves. The parameter counts stay the
    whole layer's: the stages are cut by them.
    """
    from orch.plans.parallel.stage_layers import StageLayer, whole_name
    from orch.plans.parallel.tp_plan import shard_module, split_params

    modules = [_build(spec).to(dtype=dtype) for spec in specs]
    layers = []
    for index, (spec, module) in enumerate(zip(specs, modules, strict=True)):
        params = list(module.parameters())
        tp_params, tp_trainable = 0, 0
        if tp_layer_specs and isinstance(spec, StageLayer):
            names = {own: whole_name(spec, own, index) for own, _ in module.named_modules()}
            tp_params, tp_trainable = split_params(module, tp_layer_specs, names)
            if tp > 1:
                shard_module(module, tp_layer_specs, tp, names)
        layers.append(PipelineLayer(
            name=type(module).__name__, params=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            largest_param=max((p.numel() for p in params), default=0),
            saved_bytes=0, tp_params=tp_params, tp_trainable=tp_trainable))
    saved = _SavedTensors([p for m in modules for p in m.parameters()])
    batch = move_batch(inputs.example_batch(micro_batch_size), "meta", dtype)
    x, targets = batch[0], batch[1]
    outputs = []
    weights = _WeightGradientInputs([p for m in modules for p in m.parameters() if p.requires_grad], len(modules))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), _MetaRunsAsOnCpu(), weights:
        for index, (spec, module) in enumerate(zip(specs, modules, strict=True)):
            saved.current_layer = weights.current_layer = index
            x = _run(spec, module, x)
            outputs.append(x.numel() * x.element_size())
        # The last stage computes the loss as the trainer does; its output is alive meanwhile.
        inputs.objective(x, (None, targets))
        saved.add(x)
    return [dataclasses.replace(layer, saved_bytes=saved.by_layer.get(index, 0), output_bytes=outputs[index],
                                weight_grad_bytes=weights.by_layer[index])
            for index, layer in enumerate(layers)]


class _WeightGradientInputs(TorchFunctionMode):
    """Counts, per layer, the outputs of the calls where a trainable parameter (or a tensor made from
    parameters alone: a transposed or cast weight, a tied head's) meets a tensor made from the
    layer's input: the gradients arriving there are what torch's split backward keeps for the
    weight pass (:attr:`PipelineLayer.weight_grad_bytes`). A Python function torch hands the mode
    whole (``F.multi_head_attention_forward``) counts as one call: its output only."""

    def __init__(self, parameters: list[torch.nn.Parameter], layers: int):
        super().__init__()
        # Held, not only their ids: a dropped tensor's id can be handed to another.
        self._from_parameters = {id(p): p for p in parameters}
        self.by_layer = [0] * layers
        self.current_layer = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made_from = [id(t) in self._from_parameters for t in tensors]
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors and all(made_from):
            self._from_parameters.update((id(t), t) for t in results)
        elif any(made_from):
            self.by_layer[self.current_layer] += sum(_local_bytes(t) for t in results if t.requires_grad)
        return out


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor on this rank (a DTensor's local shard)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local.numel() * local.element_size()


def carry_layers(shallow: list[PipelineLayer], deeper: list[PipelineLayer], depth: int) -> list[PipelineLayer] | None:
    """The pipeline layers of the model at ``depth``, from its layers measured at the two
    :data:`orch.plans.model.depth_scaling.SHALLOW_DEPTHS`: the same layers before and after a run of one
    repeated unit (a block, or the few layers making one), with the unit repeated ``depth``
    times. The run's first unit may differ from the others (a Hugging Face decoder's first layer
    saves tensors the later ones reuse): it is then taken as measured and the others repeated
    ``depth - 1`` times. None when the two lists do not have that shape (then the caller
    measures in full).
    """
    d1, d2 = SHALLOW_DEPTHS
    unit, extra = divmod(len(deeper) - len(shallow), d2 - d1)
    if unit < 1 or extra:
        return None
    for first in (0, 1):  # units of the run that differ from the repeated one
        n1, n2 = d1 - first, d2 - first
        for start in range(len(shallow) - unit * n1 + 1):
            before, repeated = shallow[:start], shallow[start:start + unit]
            after = shallow[start + unit * n1:]
            if shallow == before + repeated * n1 + after and deeper == before + repeated * n2 + after:
                return before + repeated * (depth - first) + after
    return None


def partition(layers: list[PipelineLayer], pp: int, method: str, engine: str) -> list[int]:
    """Stage boundaries (``pp + 1`` layer indices), as the engine splits the layers
    (:meth:`orch.plans.engines.base.EngineSpec.pipeline_partition`).

    Plain ints: numpy integers would reach the stages' ``start``/``stop`` and from there every JSON
    document (`orch check --json`, MLflow)."""
    from orch.plans.engines import engine_spec

    weighed = [(layer.name, layer.trainable) for layer in layers]
    return [int(bound) for bound in engine_spec(engine).pipeline_partition(weighed, pp, method)]


def pipeline_stages(layers: list[PipelineLayer], *, pp: int, method: str, micro_batches: int, engine: str,
                    input_bytes: int = 0, bounds: list[int] | None = None) -> list[PipelineStage]:
    """The stages of a pp-stage pipeline over ``layers``, split as ``engine`` splits them; a stage
    may come out empty (see callers).

    ``input_bytes`` is one micro-batch of the model's input (the token ids). ``bounds``: the split
    of these layers' parameters when already computed (:func:`partition`; it depends on nothing else).
    """
    bounds = bounds or partition(layers, pp, method, engine)
    stages = []
    for index in range(pp):
        part = layers[bounds[index]:bounds[index + 1]]
        received = layers[bounds[index] - 1].output_bytes if bounds[index] > 0 else input_bytes
        sent = part[-1].output_bytes if part else received
        in_flight = min(pp - index, micro_batches)
        slots = max(2, in_flight)  # TrainSchedule.num_pipe_buffers
        if index == pp - 1 and index > 0:
            # The last stage keeps every slot's outputs (the logits) until the slot is reused:
            # its _exec_backward_pass returns before the line that frees them. Their autograd graph
            # still holds the slot's received input (a leaf, referenced by its AccumulateGrad
            # node) and so that input's gradient: two boundary activations per slot besides the
            # receive buffer. Measured on CPU workers with d_model 128 and a 256-way vocabulary,
            # where the two sizes differ. The micro-batch in flight is in its slot: its received
            # input and its logits are those buffers, not more besides them.
            buffers = received + slots * (sent + 2 * received)
            boundary = received
            in_flight_bytes = 0
        else:
            buffers = (received if index > 0 else slots * received) + (sent if index < pp - 1 else slots * sent)
            boundary = (received if index > 0 else 0) + (sent if index < pp - 1 else 0)
            in_flight_bytes = in_flight * ((received if index > 0 else 0) + sent)
        stages.append(PipelineStage(
            index=index, start=bounds[index], stop=bounds[index + 1], layers=tuple(layer.name for layer in part),
            params=sum(layer.params for layer in part), trainable=sum(layer.trainable for layer in part),
            largest_param=max((layer.largest_param for layer in part), default=0),
            saved_bytes=sum(layer.saved_bytes for layer in part), in_flight=in_flight, buffer_bytes=buffers,
            boundary_buffer_bytes=boundary,
            tp_params=sum(layer.tp_params for layer in part), tp_trainable=sum(layer.tp_trainable for layer in part),
            in_flight_bytes=in_flight_bytes))
    return stages


def on_sequence_part(layers: list[PipelineLayer], cp: int) -> list[PipelineLayer]:
    """``layers`` as one of ``cp`` context-parallel ranks runs them, on ``1/cp`` of every sample's
    tokens: what a layer sends on (the hidden states, ``[batch, tokens, ...]``) and what it saves
    run along the sequence, so a rank's are ``1/cp`` of them. The saved bytes decide only each
    stage's share of the whole model's activations, which are measured on a rank's part."""
    if cp <= 1:
        return layers
    return [dataclasses.replace(layer, saved_bytes=-(-layer.saved_bytes // cp),
                                output_bytes=-(-layer.output_bytes // cp),
                                weight_grad_bytes=-(-layer.weight_grad_bytes // cp)) for layer in layers]


def stage_activations(whole: ActivationBytes, stage: PipelineStage, total_saved: int, *,
                      holds_loss: bool, held_output: int = 0, split_backward: bool = False) -> ActivationBytes:
    """One stage's activations: the whole model's measurement scaled to the stage's share of the
    saved bytes, plus the saved tensors, inputs and outputs of the micro-batches it holds in
    flight meanwhile. Three transients are not divided among the stages: the recomputation of one
    checkpointed layer in backward, which every stage with layers pays whole; the forward of the
    loss (its temporaries beside the logits) and the backward of the loss and the output head (the
    logits' gradient and the loss's temporaries, above what the forward saved), which only the
    stage computing the loss (``holds_loss``) pays, whole. The other stages' forward peaks are
    their share of the saved bytes, their backward peaks the repeated layers' share.

    ``held_output``: bytes of the loss stage's output (the logits) its engine keeps through the
    micro-batch's backward, which the unpipelined model frees once the loss has what it saves
    (torch's ``PipelineStage`` keeps a chunk's output until its ``backward_one_chunk`` returns).
    ``split_backward``: the schedule runs the weights' backward apart from the inputs' (zero bubble).

    The peaks inside the repeated layers, and those of the loss's and the head's backward on the
    loss stage, are returned apart (``blocks_backward_peak``, ``loss_backward_peak``, ...), as
    FSDP2's phases meet each with other gradients and gathers; ``backward_peak`` is the largest."""
    share = stage.saved_bytes / total_saved if total_saved else 0.0
    waiting = round((stage.in_flight - 1) * round(whole.saved * share)) + stage.in_flight_bytes
    recompute = whole.recompute_peak if stage.saved_bytes else 0

    def scaled(x: int) -> int:
        return round(x * share)

    def scaled_backward(x: int) -> int:
        # A stage recomputes one checkpointed layer at a time, as the whole model does: that
        # transient is not divided among the stages, only the rest of the backward peak is.
        return scaled(x - whole.recompute_peak) + recompute

    backward = scaled_backward(whole.backward_peak)
    tail = max(whole.loss_backward_peak, whole.head_backward_peak)
    if not tail and whole.backward_peak > whole.blocks_backward_peak:
        # Not told apart (no parameter gradient before the repeated layers': a head tied to the
        # input embedding has its weight's gradient accumulated only after the embedding's
        # backward), but the backward peak lies outside the repeated layers: at the loss and head.
        tail = whole.backward_peak
    if whole.blocks_backward_peak and tail:
        # The loss's and the head's backward measured apart from the layers' (before the first
        # parameter gradient, and up to the repeated layers).
        backward = scaled_backward(whole.blocks_backward_peak)
        if holds_loss:
            backward = max(backward, scaled(whole.saved) + tail - whole.saved)
    held = held_output if holds_loss else 0
    backward += held
    with_grads = backward + scaled(whole.backward_peak_with_grads - whole.grads_at_backward_peak - whole.backward_peak)
    # The forward's peak above the saved bytes is the loss's (the logits beside its temporaries) in
    # the models measured here: a stage without the loss peaks at what it saves.
    forward = scaled(whole.saved) + (whole.forward_peak - whole.saved if holds_loss else 0)

    # A split backward's fullest input backward holds more than the in-flight micro-batches' activations.
    deferred = stage.split_backward_bytes if split_backward else 0

    def in_blocks(x: int) -> int:
        # The stage's moments inside its repeated layers, which FSDP2's phases meet with their
        # gradients and gathers: the layers' share, the micro-batches waiting and the held output.
        return scaled_backward(x) + waiting + held + deferred if x else 0

    blocks = in_blocks(whole.blocks_backward_peak)
    # A schedule that splits backward runs a block's weight gradients after its input gradients,
    # keeping what they need meanwhile: past the first block, the stage stays at the blocks' peak.
    later, end = ((blocks, blocks) if split_backward else
                  (in_blocks(whole.later_blocks_backward_peak), in_blocks(whole.blocks_backward_end)))

    def at_tail(x: int) -> int:
        # The loss's and the head's backward, on the stage computing the loss alone.
        return scaled(whole.saved) + x - whole.saved + waiting + held if holds_loss and x else 0

    return ActivationBytes(
        saved=scaled(whole.saved) + waiting, recompute_peak=recompute,
        forward_peak=forward + waiting,
        backward_peak=backward + waiting, backward_peak_with_grads=with_grads + waiting,
        grads_at_backward_peak=0, blocks_backward_peak=blocks, later_blocks_backward_peak=later,
        blocks_backward_end=end,
        loss_backward_peak=at_tail(whole.loss_backward_peak), head_backward_peak=at_tail(whole.head_backward_peak))


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle time of the pipeline relative to its useful work: ``(pp - 1) / micro-batches``
    (GPipe / Megatron-LM's bubble; 1F1B has the same bubble, with less memory)."""
    return (pp - 1) / micro_batches if micro_batches else float("inf")


def rank_stages(stages: list[PipelineStage], layers: list[PipelineLayer], *, schedule, pp: int, virtual: int,
                micro_batches: int) -> list[PipelineStage]:
    """Each pipeline rank's stages as one (torch's schedules, where a rank runs
    ``pp_virtual_stages`` of the ``pp * pp_virtual_stages`` stages,
    :func:`orch.plans.parallel.schedules.stages_of_rank`).

    A rank holds the activations of :func:`orch.plans.parallel.schedules.micro_batches_in_flight`
    micro-batches through all its layers, and each in-flight micro-batch's outputs (what its
    stages send on) until their backward. torch's ``PipelineStage`` allocates, once, a receive
    buffer per micro-batch for each input it receives and for each output's gradient
    (``_prepare_forward_infra`` / ``_prepare_backward_infra``): those are its buffers.
    """
    from orch.plans.parallel.schedules import micro_batches_in_flight, stages_of_rank

    last = len(stages) - 1
    ranks = []
    for rank in range(pp):
        mine = [stages[s] for s in stages_of_rank(rank, pp, virtual, schedule)]
        received = sum(layers[s.start - 1].output_bytes for s in mine if 0 < s.start <= len(layers))
        sent = sum(layers[s.stop - 1].output_bytes for s in mine if s.index < last and s.stop > s.start)
        held = micro_batches_in_flight(schedule, pp, virtual, micro_batches, rank)  # an average: may be fractional
        split = (_split_backward_bytes(mine, layers, schedule, pp, virtual, micro_batches, rank, held)
                 if schedule.splits_backward else 0)
        ranks.append(PipelineStage(
            index=rank, start=min(s.start for s in mine), stop=max(s.stop for s in mine),
            layers=tuple(name for s in mine for name in s.layers), params=sum(s.params for s in mine),
            trainable=sum(s.trainable for s in mine), largest_param=max(s.largest_param for s in mine),
            saved_bytes=sum(s.saved_bytes for s in mine), in_flight=held,
            tp_params=sum(s.tp_params for s in mine), tp_trainable=sum(s.tp_trainable for s in mine),
            buffer_bytes=micro_batches * (received + sent), in_flight_bytes=round(held * sent),
            split_backward_bytes=split))
    return ranks


def _split_backward_bytes(mine: list[PipelineStage], layers: list[PipelineLayer], schedule, pp: int, virtual: int,
                          micro_batches: int, rank: int, in_flight: float) -> int:
    """:attr:`PipelineStage.split_backward_bytes` of rank ``rank`` of a schedule that splits
    backward, whose stages (chunks) are ``mine``: at each of its fullest input backwards, each
    chunk's held micro-batches' saved bytes and its waiting weight backwards' output gradients,
    above ``in_flight`` micro-batches through all its chunks. The first stage keeps no gradients
    for later: torch runs its whole backward in its weight pass, having no input to send a
    gradient to."""
    from orch.plans.parallel.schedules import split_backward_moments

    saved = [stage.saved_bytes for stage in mine]
    kept = [0 if stage.index == 0 else sum(layer.weight_grad_bytes for layer in layers[stage.start:stage.stop])
            for stage in mine]
    fullest = max(sum(h * b for h, b in zip(moment.held, saved, strict=True))
                  + sum(w * b for w, b in zip(moment.waiting_weights, kept, strict=True))
                  for moment in split_backward_moments(schedule, pp, virtual, micro_batches, rank))
    return max(0, round(fullest - in_flight * sum(saved)))
