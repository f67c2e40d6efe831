"""How an FSDP2 run lays a model over its ranks: the device meshes, the blocks sharded one by
one, FSDP2's options from the plan, and tensor parallelism through DTensor.

The rank layout is the project's (:func:`orch.plans.parallel.rank_layout.parallel_coords`: tp innermost, dp
outermost), which a row-major ``(dp, tp)`` mesh reproduces; :func:`meshes` checks that it does.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orch.plans.engines.fsdp2_memory import fsdp_mesh

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from orch.plans.parallel.rank_layout import ParallelCoords
    from orch.plans.parallel.sequence_parallel import SequenceParallelLayout
    from orch.plans.parallel.vocab_parallel import OutputHead
    from orch.plans.resolve import ResolvedPlan

_HF_STYLES = ("colwise", "rowwise")
"""The Hugging Face tp-plan styles applied; the others (``embedding_rowwise``,
``colwise_gather_output``) leave their layer replicated, as DeepSpeed's AutoTP runs do."""


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks ``fully_shard`` wraps one at a time, so one block's parameters are gathered at a time.

    A *stack* is a ``ModuleList`` or ``Sequential`` of at least two modules of one class that
    have children of their own (a ``Sequential`` of bare ``Linear`` layers is one layer's insides,
    not a stack of blocks). The blocks are the items of the stack holding the most parameters
    (the GPT's ``blocks``, a Hugging Face decoder's ``layers``, torchvision ViT's
    ``encoder.layers``) and of every other outermost stack of the same block class (a ResNet's
    four stages of bottlenecks). A model without a stack gets no per-block units: the root alone
    is sharded, and its whole parameter set is gathered for each forward and backward.
    """
    import torch

    stacks = []
    for module in model.modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and all(next(child.children(), None) is not None for child in module):
            stacks.append(module)
    if not stacks:
        return []
    largest = max(stacks, key=lambda s: sum(p.numel() for p in s.parameters()))
    kind = type(largest[0])
    blocks, inside = [], set()
    for stack in stacks:
        if type(stack[0]) is not kind or id(stack) in inside:
            continue
        blocks += list(stack)
        inside.update(id(sub) for sub in stack.modules())
    return blocks


@dataclass(frozen=True)
class Meshes:
    """The device meshes of an fsdp2 run."""

    dp: DeviceMesh
    """What FSDP2 shards over (2-D, replicate x shard, with ``plan.fsdp.hybrid``; the data- and
    context-parallel ranks together, flattened, with ``plan.cp > 1``)."""
    tp: DeviceMesh | None = None
    """The tensor-parallel ranks (None at tp=1)."""
    pp: DeviceMesh | None = None
    """The pipeline ranks at this rank's dp and tp coordinates (None at pp=1)."""
    cp: DeviceMesh | None = None
    """The context-parallel ranks, which split each sample's sequence (None at cp=1)."""


def meshes(plan: ResolvedPlan, device_type: str, coords: ParallelCoords) -> Meshes:
    """The data-parallel mesh FSDP2 shards over, the tensor-parallel, pipeline and context-parallel ones.

    One N-D mesh, ``(dp, pp, cp, tp)`` row-major as the project's rank layout is
    (:func:`orch.plans.parallel.rank_layout.parallel_coords`: tp innermost, dp outermost).
    With ``plan.fsdp.hybrid`` the data-parallel dimension is 2-D, (replicate, shard), its shard
    dimension the data-parallel ranks of one node (``LOCAL_WORLD_SIZE / (tp * pp)``): parameters
    are sharded inside a node and replicated across nodes, so the all-gathers stay on the node's links.
    With ``plan.cp > 1`` FSDP2 shards over the data- and context-parallel ranks together (one
    flattened dimension, as torchtitan's ``dp_shard_cp``): the context-parallel ranks hold the same
    parameters, and their gradients are averaged with the data-parallel ones'.
    """
    from torch.distributed.device_mesh import init_device_mesh

    dims, names = [plan.dp], ["dp_shard"]
    if plan.fsdp.hybrid:
        # The planner's mesh (orch.plans.engine_settings.fsdp_mesh), at the workers this node really holds.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
        layout = fsdp_mesh(plan, local)
        if local % (plan.tp * plan.pp) or layout.shard * layout.replicate != plan.dp:
            raise RuntimeError(f"plan.fsdp.hybrid: the {local} workers per node (LOCAL_WORLD_SIZE) must be a multiple "
                               f"of plan.tp({plan.tp}) * plan.pp({plan.pp}) and hold a divisor of plan.dp({plan.dp}) "
                               "replicas; set plan.fsdp.hybrid=false or change the workers per node")
        dims, names = [layout.replicate, layout.shard], ["dp_replicate", "dp_shard"]
    dp_names = tuple(names)
    for name, degree in (("pp", plan.pp), ("cp", plan.cp), ("tp", plan.tp)):
        if degree > 1:
            dims, names = [*dims, degree], [*names, name]
    mesh = init_device_mesh(device_type, tuple(dims), mesh_dim_names=tuple(names))
    if plan.cp > 1:
        # With pipeline stages dp and cp are not neighbours in the mesh (dp, pp, cp, tp): the slice
        # keeps this rank's stage, whose data- and context-parallel ranks FSDP2 shards it over.
        dp_mesh = mesh[(*dp_names, "cp")]._flatten(mesh_dim_name="dp_shard_cp")
    else:
        dp_mesh = mesh[dp_names] if len(names) > len(dp_names) else mesh
    found = Meshes(dp=dp_mesh, tp=mesh["tp"] if plan.tp > 1 else None, pp=mesh["pp"] if plan.pp > 1 else None,
                   cp=mesh["cp"] if plan.cp > 1 else None)
    where = dict(zip(names, mesh.get_coordinate(), strict=True))
    dp_rank = where["dp_replicate"] * dims[1] + where["dp_shard"] if plan.fsdp.hybrid else where["dp_shard"]
    placed = (dp_rank, where.get("tp", 0), where.get("pp", 0), where.get("cp", 0))
    expected = (coords.dp_rank, coords.tp_rank, coords.pp_rank, coords.cp_rank)
    if placed != expected:
        raise RuntimeError(f"rank {mesh.get_rank()}: the device mesh placed it at (dp_rank, tp_rank, pp_rank, cp_rank) "
                           f"= {placed}, the orchestrator at {expected}")
    return found


def fsdp_options(plan: ResolvedPlan, dp_mesh: DeviceMesh) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for ``plan``: the mesh, ``reshard_after_forward``,
    the mixed-precision policy (parameters in the training precision, gradients reduced in fp32)
    and, with ``plan.offload_param=cpu``, CPU offload of parameters, gradients and the optimizer
    step (FSDP2 offloads the three together)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": plan.fsdp.reshard_after_forward}
    if plan.precision.value != "fp32":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=plan.precision.dtype, reduce_dtype=torch.float32)
    if plan.offload_param.value == "cpu":
        # Pinned host memory makes the copies to a GPU asynchronous; CPU workers have no GPU to pin for.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=plan.accelerator.value == "gpu")
    elif plan.offload_param.value != "none":
        raise RuntimeError(f"plan.offload_param={plan.offload_param.value}: FSDP2 offloads to cpu only; set "
                           "plan.offload_param=cpu or none, or plan.engine=deepspeed")
    return options


def autotp_styles(model: torch.nn.Module, layer_specs: list[dict],
                  match_names: dict[str, str] | None = None) -> dict[str, str]:
    """Module name -> 'column' or 'row' for the layers the AutoTP specs shard, matched as DeepSpeed's
    AutoTP matches them (:func:`orch.plans.parallel.tp_plan.split_layers`: the first matching spec decides, a
    ``skip`` or a weight that is not a matrix leaves the layer whole), so both engines and the
    planner shard the same layers.

    A fused layer whose spec gives a ``shape`` (the GPT's ``qkv``, three matrices in one) cannot be
    split by a plain column-wise style: it is refused rather than sharded wrongly.
    """
    from orch.plans.parallel.tp_plan import split_layers

    fused = [spec for spec in layer_specs
             if spec.get("partition_type") != "skip" and ("shape" in spec or "partition_dim" in spec)]
    if fused:
        raise RuntimeError(f"tensor-parallel spec {fused[0]} splits a fused layer, which plan.engine=fsdp2 cannot "
                           "shard with DTensor's column/row styles; set plan.engine=deepspeed (AutoTP) or plan.tp=1")
    return split_layers(model, layer_specs, match_names)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, layer_specs: list[dict] | None, *,
                          match_names: dict[str, str] | None = None, hf_plan: dict | None = None,
                          sequence: SequenceParallelLayout | None = None, heads: Sequence[OutputHead] = ()) -> int:
    """Shard ``model``'s linear layers over ``tp_mesh`` with DTensor's column- and row-wise styles;
    returns how many were sharded.

    The model's own Hugging Face tensor-parallel plan (``model._tp_plan``, or ``hf_plan``: module
    patterns with ``*`` for a layer index) is used where it has one; otherwise the workload's
    AutoTP layer specs (regexes over ``<module>.weight``, :func:`autotp_styles`). A pipeline
    stage is matched by the whole model's names (``match_names``: its module names -> the
    model's), so its layers are sharded as the unpipelined model's are. With ``sequence``, the
    residual stream is split along the sequence as well (:func:`apply_sequence_parallel`).

    ``heads``, the output head ``plan.loss_parallel`` splits over the vocabulary
    (:mod:`orch.plans.parallel.vocab_parallel`), is column-parallel whatever the plan says of it,
    its logits left split along their last dimension (a DTensor), as torch's ``loss_parallel``
    takes them; its input is the whole hidden state (under sequence parallelism the final norm's
    output is gathered for it). A tied head's embedding is split by rows with it (row-parallel:
    the lookups all-reduced); a linear head sharing the embedding's weight is split by the same
    rows, and tied to the embedding's shard again once both are; a tied head without a module of
    its own (``name`` ""; a pipeline stage's copy computing the logits in its forward function) has
    only its embedding split. Pipeline stages may hold several copies of a tied head, hence a
    sequence. Without ``heads`` an output head stays whole (the Hugging Face plans'
    ``colwise_gather_output`` is not applied).
    """
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "column": ColwiseParallel, "row": RowwiseParallel}
    names = [name for name, module in model.named_modules() if name]
    as_named = match_names or {name: name for name in names}
    plan: dict[str, Any] = {}
    if hf_plan is None:
        hf_plan = getattr(model, "_tp_plan", None)
    if isinstance(hf_plan, dict) and hf_plan:
        for pattern, style in hf_plan.items():
            if style not in _HF_STYLES:
                continue
            body = r"\d+".join(re.escape(part) for part in pattern.split("*"))
            for name in names:
                if re.fullmatch(body, as_named.get(name, name)):
                    plan[name] = styles[style]()
    else:
        plan = {name: styles[kind]() for name, kind in autotp_styles(model, layer_specs or [], match_names).items()}
    tied_linears: list[OutputHead] = []
    for head in heads:
        if head.embedding is None:
            plan[head.name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            continue
        # The embedding's rows split (each rank looks up the tokens of its part of the vocabulary,
        # the lookups summed); the tied head is handed that shard, its input made a replicated
        # DTensor so the logits come out split along their last dimension, as loss_parallel takes them.
        plan[head.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if not head.name:
            continue
        if isinstance(model.get_submodule(head.name), torch.nn.Linear):
            # Its weight is the embedding's: split by the same rows (both styles shard dim 0), each
            # into a parameter of its own by parallelize_module, tied again after it.
            tied_linears.append(head)
            plan[head.name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        else:
            plan[head.name] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                 desired_input_layouts=(Replicate(), None), use_local_output=False)
    if not plan:
        raise RuntimeError(f"plan.tp={tp_mesh.size()}, but no layer of {type(model).__name__} matched its tensor-"
                           "parallel plan: every rank would hold and compute the whole model")
    if sequence is not None:
        from orch.plans.parallel.sequence_parallel import SEQUENCE_DIM

        for name in sequence.row_layers:
            plan[name] = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))
    parallelize_module(model, tp_mesh, plan)
    for head in tied_linears:
        model.get_submodule(head.name).weight = model.get_submodule(head.embedding).weight
    if sequence is not None:
        apply_sequence_parallel(model, tp_mesh, sequence)
    return len(plan)


def loss_context(split_head: bool):
    """What a step's forward, loss and backward (and evaluation) run inside when the output head is
    split over the vocabulary: torch's ``loss_parallel``, which takes the split logits; else nothing."""
    if not split_head:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def context_parallel_text(cp: int) -> str:
    """The engine's build line's words for each sequence split over ``cp`` context-parallel ranks."""
    return f", each sample's sequence split over {cp} context-parallel ranks"


def split_head_text(name: str, embedding: str | None = None) -> str:
    """The engine's build line's words for an output head split over the vocabulary (with its tied
    ``embedding``)."""
    tied = f" with its tied embedding {embedding}" if embedding else ""
    return f", the output head split over the vocabulary{tied} (loss parallel, {name})"


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let torch.compile overlap the tensor-parallel collectives with their matmuls (``plan.async_tp``).

    Inductor's micro-pipelined TP pass (``torch._inductor.config._micro_pipeline_tp``) rewrites
    each all-gather feeding a matmul and each matmul feeding a reduce-scatter, the pairs sequence
    parallelism leaves around the column- and row-parallel layers, into torch's fused
    ``symm_mem`` ops: the matmul runs in tp chunks, each as soon as its chunk of the collective
    has arrived through the node's symmetric memory, which the tensor-parallel group must have
    enabled first. Set before the blocks are compiled (the pass runs when a graph is compiled,
    at the first step). CUDA only; the planner refuses the setting elsewhere.
    """
    import warnings

    import torch
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    if tp_mesh.device_type != "cuda":
        raise RuntimeError(f"plan.async_tp=true needs CUDA devices for symmetric memory, and the tensor-parallel "
                           f"mesh is on {tp_mesh.device_type}; set plan.async_tp=false")
    with warnings.catch_warnings():
        # Deprecated in favour of automatic registration, which this torch does not do yet for async TP.
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True


def sequence_layout(model: torch.nn.Module, layer_specs: list[dict] | None) -> SequenceParallelLayout:
    """Where ``plan.sequence_parallel`` splits ``model`` (the planner checked that it can)."""
    from orch.plans.parallel.sequence_parallel import layout_of

    layout = layout_of(model, layer_specs)
    if isinstance(layout, str):
        raise RuntimeError(f"plan.sequence_parallel=true: {layout}; set plan.sequence_parallel=false")
    return layout


def apply_sequence_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, layout: SequenceParallelLayout) -> None:
    """Split ``model``'s residual stream along the sequence over ``tp_mesh`` (``plan.sequence_parallel``),
    after :func:`apply_tensor_parallel` sharded its linear layers, the row-parallel ones with
    their outputs reduce-scattered to the slice.

    DTensor's styles, as torchtitan lays out a decoder: each norm runs on its slice
    (``SequenceParallel``, its weight replicated, its gradient summed over the slices) and its
    output is all-gathered (``PrepareModuleOutput`` to ``Replicate``); a block norm's output stays
    a DTensor, so the column-parallel layers' partial input gradients are reduce-scattered back to
    the slice in one collective; the final norm's is a plain tensor for the head (whole, or split
    over the vocabulary). Each row-parallel layer reduce-scatters to the slice instead of
    all-reducing. The first block's input is split where it enters the block, not at the
    embedding: a model computes its positions and masks from the embedding's output, which keeps
    the whole sequence.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module
    from torch.distributed.tensor.parallel import SequenceParallel as SequenceParallelStyle

    from orch.plans.parallel.sequence_parallel import SEQUENCE_DIM

    sequence = Shard(SEQUENCE_DIM)
    norms = (*layout.block_norms, *([layout.final_norm] if layout.final_norm else []))
    parallelize_module(model, tp_mesh, {name: SequenceParallelStyle(sequence_dim=SEQUENCE_DIM, use_local_output=False)
                                        for name in norms})
    gathers = {name: PrepareModuleOutput(output_layouts=sequence, desired_output_layouts=Replicate(),
                                         use_local_output=name == layout.final_norm)
               for name in norms}
    parallelize_module(model, tp_mesh, gathers)

    def split_input(_module, args, kwargs):
        # The whole hidden states, the same on every rank, to this rank's slice; backward all-gathers
        # the slices' gradients for the embedding.
        def split(hidden):
            return DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False).redistribute(
                tp_mesh, [sequence]).to_local()

        if args:
            return (split(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise RuntimeError(f"plan.sequence_parallel=true: {layout.first_block} was called without its input as "
                               "the first argument or hidden_states=; set plan.sequence_parallel=false")
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}

    if layout.first_block is not None:
        model.get_submodule(layout.first_block).register_forward_pre_hook(split_input, with_kwargs=True)
