"""A pipelined model's stages on one rank, and what their state is called.

The model's neutral pipeline layers (:class:`orch.plans.parallel.stage_layers.StageLayer`) are
cut into ``pp * pp_virtual_stages`` stages as the planner cuts them
(:meth:`orch.plans.engines.fsdp2.FSDP2Spec.pipeline_partition`); each rank builds only the stages
its schedule gives it (:func:`orch.plans.parallel.schedules.stages_of_rank`), each a
:class:`StageModule`, together a :class:`Stages`.

Names: a layer that says where its state sits in the whole model (``StageLayer.names``) is
saved under those names (:class:`StateNames`), so a pipelined checkpoint is the unpipelined
model's and resumes at any pp (and dp, tp: DCP reshards). Layers sharing a weight (a tied
embedding and output head) each keep a copy, saved once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orch.plans.parallel.schedules import rank_of_stage, stages_of_rank
from orch.plans.parallel.stage_layers import StageLayer, whole_name
from orch.plans.spec import PipelineSchedule

if TYPE_CHECKING:
    from orch.plans.resolve import ResolvedPlan


class StageModule(nn.Module):
    """Layers ``[start, stop)`` of the pipeline as one module, run in order; a tied copy runs
    through its ``forward_fn``. Layers of one tie key within the stage share one module."""

    def __init__(self, specs: list[StageLayer], start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.layers = nn.ModuleList()
        self._forward_fns: list[Callable[[nn.Module, Any], Any] | None] = []
        shared: dict[str, nn.Module] = {}
        for spec in specs[start:stop]:
            module = shared.get(spec.tie) if spec.tie is not None else None
            if module is None:
                module = spec.build()
                if spec.tie is not None:
                    shared[spec.tie] = module
            self.layers.append(module)
            self._forward_fns.append(spec.forward_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module, forward_fn in zip(self.layers, self._forward_fns, strict=True):
            x = forward_fn(module, x) if forward_fn is not None else module(x)
        return x


@dataclass(frozen=True)
class Cut:
    """Where the layers are cut: stage ``s`` runs layers ``bounds[s]:bounds[s + 1]``."""

    bounds: list[int]
    schedule: PipelineSchedule
    pp: int
    virtual: int

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def mine(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs."""
        return stages_of_rank(pp_rank, self.pp, self.virtual, self.schedule)

    def rank_of(self, stage: int) -> int:
        return rank_of_stage(stage, self.pp, self.virtual, self.schedule)

    def stage_of_layer(self, layer: int) -> int:
        return next(s for s in range(self.stages) if self.bounds[s] <= layer < self.bounds[s + 1])


def cut(specs: list[StageLayer], plan: ResolvedPlan) -> Cut:
    """The stage bounds of ``specs`` under ``plan``, as the planner splits them."""
    from orch.plans.engines import engine_spec

    weighed = [(spec.name, _trainable(spec)) for spec in specs]
    bounds = [int(b) for b in engine_spec(plan.engine).pipeline_partition(weighed, plan.pipeline_stages,
                                                                          plan.pp_partition)]
    empty = [s for s in range(len(bounds) - 1) if bounds[s] == bounds[s + 1]]
    if empty:
        raise RuntimeError(f"pipeline stage(s) {empty} of {len(bounds) - 1} got no layer "
                           f"(plan.pp_partition={plan.pp_partition}, bounds {bounds}); set a smaller plan.pp or "
                           "plan.pp_virtual_stages, or plan.pp_partition=uniform")
    return Cut(bounds=bounds, schedule=plan.pp_schedule, pp=plan.pp, virtual=plan.pp_virtual_stages)


def _trainable(spec: StageLayer) -> int:
    from orch.plans.model.meta import meta_device

    with meta_device():
        module = spec.build()
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def block_class(specs: list[StageLayer]) -> Callable[..., nn.Module] | None:
    """The repeated layer (the transformer block): the module most of the layers are built from,
    if one is built more than once. FSDP2 shards each such layer as a unit and recomputation
    wraps them."""
    counts = Counter(spec.module for spec in specs if spec.tie is None)
    if not counts:
        return None
    module, count = counts.most_common(1)[0]
    return module if count > 1 else None


class Stages(nn.Module):
    """This rank's stages, by stage index (``"2"``): one module the optimizer, DCP and the
    engine's other parts see, whose parameter names :meth:`whole_names` maps to the model's."""

    def __init__(self, specs: list[StageLayer], layout: Cut, pp_rank: int):
        super().__init__()
        self.specs, self.layout = specs, layout
        self.indices = layout.mine(pp_rank)
        self.parts = nn.ModuleDict({str(s): StageModule(specs, layout.bounds[s], layout.bounds[s + 1])
                                    for s in self.indices})

    def whole_names(self) -> dict[str, str]:
        """Every parameter's and buffer's name here -> its name in the whole model."""
        names = {}
        for stage, part in self.parts.items():
            for j, module in enumerate(part.layers):
                index = part.start + j
                for own, _ in [*module.named_parameters(remove_duplicate=False),
                               *module.named_buffers(remove_duplicate=False)]:
                    names[f"parts.{stage}.layers.{j}.{own}"] = whole_name(self.specs[index], own, index)
        return names

    def tie_copies(self) -> dict[str, list[nn.Parameter]]:
        """For each tie key, this rank's copies of the shared weight (one per stage holding it)."""
        copies: dict[str, list[nn.Parameter]] = {}
        for part in self.parts.values():
            seen: set[int] = set()
            for j, module in enumerate(part.layers):
                spec = self.specs[part.start + j]
                if spec.tie is None or id(module) in seen:
                    continue
                seen.add(id(module))
                for attr in spec.tied_weights:
                    copies.setdefault(f"{spec.tie}:{attr}", []).append(module.get_parameter(attr))
        return copies

    def layers_with(self, attribute: str) -> list[nn.Module]:
        """This rank's pipeline layers that have ``attribute``, which the engine sets on them
        (:func:`orch.plans.parallel.stage_layers.declared`: ``sequence_shards``, ``context_positions``)."""
        return [module for part in self.parts.values() for module in part.layers if hasattr(module, attribute)]

    def tie_ranks(self) -> dict[str, list[int]]:
        """For each tie key, the pipeline ranks holding a copy (across every rank, not only this one)."""
        holders: dict[str, set[int]] = {}
        for index, spec in enumerate(self.specs):
            if spec.tie is not None:
                for attr in spec.tied_weights:
                    holders.setdefault(f"{spec.tie}:{attr}", set()).add(
                        self.layout.rank_of(self.layout.stage_of_layer(index)))
        return {key: sorted(ranks) for key, ranks in holders.items()}

    def duplicate_copies(self) -> set[int]:
        """ids of the tie copies that are not their weight's first (counted once in a norm)."""
        first = {}
        for index, spec in enumerate(self.specs):
            if spec.tie is not None:
                first.setdefault(spec.tie, self.layout.stage_of_layer(index))
        duplicates: set[int] = set()
        for stage, part in self.parts.items():
            for j, module in enumerate(part.layers):
                spec = self.specs[part.start + j]
                if spec.tie is not None and int(stage) != first[spec.tie]:
                    duplicates.update(id(p) for p in module.parameters())
        return duplicates


def whole_key(key: str, names: dict[str, str], ordered: list[str]) -> tuple[str, str | None]:
    """``key`` of a model state dict or of DCP's flattened optimizer state dict with its
    parameter name replaced by the whole model's, and that parameter's own name (None when the
    key names no parameter or buffer of ``names``)."""
    head, rest = "", key
    for kind in ("state.", "param_groups."):
        if key.startswith(kind):
            head, rest = kind, key[len(kind):]
            break
    for own in ordered:
        if rest == own or rest.startswith(own + "."):
            return head + names[own] + rest[len(own):], own
    return key, None


class StateNames:
    """Renames this rank's state dicts to the whole model's names and back (see the module docstring).

    A copy of a shared weight other than its first stage's (and the rest of that copy's layer:
    the last stage's tied embedding also holds position embeddings it never trains) is left out
    of what is saved, so each name is written once, from its trained copy; on load it is filled
    from the first copy's saved state, so every copy starts equal again."""

    def __init__(self, stages: Stages):
        self.names = stages.whole_names()
        self.ordered = sorted(self.names, key=len, reverse=True)
        duplicates = stages.duplicate_copies()
        self.duplicate_names = {f"parts.{s}.layers.{j}.{own}"
                                for s, part in stages.parts.items() for j, module in enumerate(part.layers)
                                for own, p in module.named_parameters(remove_duplicate=False) if id(p) in duplicates}

    def to_save(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` under the whole model's names, copies of shared weights left out."""
        out = {}
        for key, value in state.items():
            whole, own = whole_key(key, self.names, self.ordered)
            if own not in self.duplicate_names:
                out[whole] = value
        return out

    def to_load(self, state: dict[str, Any]) -> dict[str, Any]:
        """What DCP loads into: ``state`` under the whole model's names, each name once (a copy
        whose first copy is on this rank too is filled from it, :meth:`loaded`)."""
        out = {}
        for key, value in sorted(state.items(), key=lambda item: whole_key(item[0], self.names, self.ordered)[1]
                                 in self.duplicate_names):
            whole, _ = whole_key(key, self.names, self.ordered)
            out.setdefault(whole, value)
        return out

    def loaded(self, own_keys: list[str], loaded: dict[str, Any]) -> dict[str, Any]:
        """The loaded state under this rank's own names again, every copy of a shared weight
        given its first copy's values."""
        return {key: loaded[whole_key(key, self.names, self.ordered)[0]] for key in own_keys}


def layer_of_module(name: str) -> str | None:
    """The pipeline layer holding submodule ``name`` of the stages, ``parts.<s>.layers.<j>``, or
    None for a name outside the layers."""
    parts = name.split(".", 4)
    if len(parts) < 4 or parts[0] != "parts" or parts[2] != "layers":
        return None
    return ".".join(parts[:4])


def whole_name_of_module(stages: Stages, name: str) -> str:
    """The whole model's name of submodule ``name`` of ``stages`` (``parts.<s>.layers.<j>.<rest>``)."""
    if layer_of_module(name) is None:
        return name
    parts = name.split(".", 4)
    part = stages.parts[parts[1]]
    index = part.start + int(parts[3])
    return whole_name(stages.specs[index], parts[4] if len(parts) > 4 else "", index)
