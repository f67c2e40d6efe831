"""Where sequence parallelism splits a model: the norms that run on a slice of the sequence, the
row-parallel layers whose outputs are reduce-scattered instead of all-reduced, and the first block,
whose input is split.

Megatron-LM's sequence parallelism (Korthikanti et al., 2022) runs what tensor parallelism leaves
whole on every rank (layer norms, residual adds, dropout) on ``1/tp`` of the sequence: the
residual stream between blocks is split along the sequence, each norm's output is all-gathered
in front of the column-parallel layers, and each row-parallel layer's all-reduce becomes a
reduce-scatter back to the slice. The bytes on the wire are the same (an all-reduce is a
reduce-scatter and an all-gather); the activations and the memory-bound work outside the split
layers shrink by ``tp``.

The layout is read off the module tree, for any model whose repeated blocks are pre-norm
residual blocks over ``[batch, sequence, hidden]`` tensors (Hugging Face decoders such as Llama,
Mistral and Qwen2): each block holds its norms as direct children, one per row-parallel layer (a
norm opens each residual branch, a row-parallel layer closes it), and the final norm is a sibling
of the block stack. A model of another shape gets a reason instead of a layout. The
fsdp2 engine applies the layout with DTensor's styles, the planner measures activations with it
on ``meta``. Only torch (and the pure tensor-parallel plan reader) is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from orch.plans.parallel.tp_plan import split_layers

SEQUENCE_DIM = 1
"""The sequence dimension of the residual stream, ``[batch, sequence, hidden]``."""


@dataclass(frozen=True)
class SequenceParallelLayout:
    """Module names (``named_modules``) sequence parallelism acts on."""

    first_block: str | None
    """The first repeated block: its input is split along the sequence (None: a pipeline stage
    without it, whose input arrives split)."""
    block_norms: tuple[str, ...]
    """The norms inside the blocks: run on a slice, their outputs all-gathered."""
    final_norm: str | None
    """The norm after the last block: runs on a slice, its output all-gathered for the head (None: a
    pipeline stage without it, whose output leaves split)."""
    row_layers: tuple[str, ...]
    """The row-parallel layers closing each residual branch: outputs reduce-scattered to a slice."""


def _is_norm(module: nn.Module) -> bool:
    """A normalization layer with no children of its own (LayerNorm, RMSNorm, a Hugging Face
    ``LlamaRMSNorm``), told by its class name as the models spell it."""
    return "norm" in type(module).__name__.lower() and next(module.children(), None) is None


def _block_stack(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """(the stack's name, its blocks) for the ``ModuleList``/``Sequential`` of one block class
    holding the most parameters, or None."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1 or next(module[0].children(), None) is None:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, [(f"{name}.{index}" if name else str(index), child)
                                 for index, child in enumerate(module)])
    return None if best is None else (best[1], best[2])


def sequence_parallel_layout(model: nn.Module, kinds: dict[str, str]) -> SequenceParallelLayout | str:
    """The layout of ``model`` under tensor parallelism sharding the layers of ``kinds`` (module
    name -> 'column' or 'row', :func:`orch.plans.parallel.tp_plan.split_layers`), or why there is none."""
    found = _block_stack(model)
    if found is None:
        return f"{type(model).__name__} has no stack of repeated blocks to split the sequence between"
    stack, blocks = found
    block_norms: list[str] = []
    row_layers: list[str] = []
    for name, block in blocks:
        norms = [f"{name}.{child}" for child, module in block.named_children() if _is_norm(module)]
        rows = sorted(layer for layer, kind in kinds.items() if kind == "row" and layer.startswith(f"{name}."))
        if not norms or len(norms) != len(rows):
            return (f"block {name} ({type(block).__name__}) has {len(norms)} norm(s) as direct children and "
                    f"{len(rows)} row-parallel layer(s); sequence parallelism needs pre-norm residual branches, "
                    "one norm opening and one row-parallel layer closing each")
        block_norms += norms
        row_layers += rows
    parent_name = stack.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    finals = [f"{parent_name}.{child}" if parent_name else child
              for child, module in parent.named_children() if _is_norm(module)]
    if len(finals) != 1:
        return (f"{type(model).__name__} has {len(finals)} norm(s) beside its block stack {stack}; sequence "
                "parallelism needs exactly one final norm after the last block")
    return SequenceParallelLayout(first_block=blocks[0][0], block_norms=tuple(block_norms), final_norm=finals[0],
                                  row_layers=tuple(row_layers))


def layout_of(model: nn.Module, layer_specs: list[dict] | None) -> SequenceParallelLayout | str:
    """:func:`sequence_parallel_layout` of ``model`` under tensor parallelism by the AutoTP
    ``layer_specs``, which say its row-parallel layers."""
    return sequence_parallel_layout(model, split_layers(model, layer_specs or []))


def stage_layout(whole: SequenceParallelLayout, names: dict[str, str]) -> SequenceParallelLayout:
    """``whole`` (the whole model's layout) as one pipeline stage sees it: ``names`` maps the
    stage's module names to the whole model's, one module per whole name; what the stage does not
    hold is left out."""
    wanted = {whole.first_block, whole.final_norm, *whole.block_norms, *whole.row_layers}
    own: dict[str, str] = {}
    for name, whole_name in names.items():
        if whole_name in wanted and own.setdefault(whole_name, name) != name:
            raise ValueError(f"stage modules {own[whole_name]} and {name} both stand for {whole_name}")
    return SequenceParallelLayout(first_block=own.get(whole.first_block or ""),
                                  block_norms=tuple(own[n] for n in whole.block_norms if n in own),
                                  final_norm=own.get(whole.final_norm or ""),
                                  row_layers=tuple(own[n] for n in whole.row_layers if n in own))


def split_sequence_on_meta(module: nn.Module, layer_specs: list[dict], tp: int) -> nn.Module:
    """``module`` (one tensor-parallel rank's shard on ``meta``, :func:`orch.plans.parallel.tp_plan.shard_module`)
    with its residual stream cut to ``1/tp`` of the sequence as sequence parallelism runs it, for
    measuring activations: the first block takes a slice of its input, each norm runs on the slice
    and its output stands in for the all-gathered whole (``tp`` copies concatenated, which backward
    keeps nothing of), and each row-parallel layer's output is cut to the slice. What the layers
    save is then what one rank saves: the norms' tensors at ``1/tp``, the gathered inputs of the
    column-parallel layers whole. Changed in place (forward hooks), and returned."""
    import torch

    layout = layout_of(module, layer_specs)
    if isinstance(layout, str):
        raise ValueError(layout)

    def cut(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.narrow(SEQUENCE_DIM, 0, hidden.shape[SEQUENCE_DIM] // tp).clone()

    def cut_input(_module, args, kwargs):
        if args:
            return (cut(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": cut(kwargs["hidden_states"])}

    def gathered(_module, _args, output):
        return torch.cat([output] * tp, dim=SEQUENCE_DIM)

    def cut_output(_module, _args, output):
        return cut(output)

    module.get_submodule(layout.first_block).register_forward_pre_hook(cut_input, with_kwargs=True)
    for name in (*layout.block_norms, *([layout.final_norm] if layout.final_norm else [])):
        module.get_submodule(name).register_forward_hook(gathered)
    for name in layout.row_layers:
        module.get_submodule(name).register_forward_hook(cut_output)
    return module
