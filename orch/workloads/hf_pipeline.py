"""Pipeline stages of a Hugging Face decoder LM (``model=hf_causal_lm`` with ``plan.pp > 1``).

A model fits when its structure is *embeddings -> N identical decoder layers -> final norm ->
LM head*: the causal LM holds a base model (``base_model_prefix``) and an output projection
(``get_output_embeddings()``); the base model holds the input embedding
(``get_input_embeddings()``), one ``ModuleList`` of decoder layers of one class, and, after it,
one module with parameters, the final norm. That is read off the model built on ``meta``, not
off a list of model types: Llama, Mistral, Qwen2, Gemma, GPT-NeoX and GPT-2 all have it.

Each pipeline layer runs the model's own code, so it computes what the unpipelined model does:

* :class:`InputEmbedding` is the base model with no decoder layers and no final norm: its own
  forward turns token ids into hidden states (learned positions, embedding scale, dropout).
* :class:`DecoderLayer` calls decoder layer ``i`` with the arguments the base model's forward
  gives it (causal mask, the rotary module's cos/sin, position ids). Stages pass tensors only,
  so every stage recomputes them: :class:`LayerArguments` runs the base model's forward on the
  stage's hidden states with each decoder layer replaced by a recorder, and no weights of size.
* :class:`FinalNorm` is the base model's final norm.
* :class:`OutputHead` is the causal LM with its base model replaced by the hidden states: its own
  forward computes the logits (and any scaling of them). With tied input and output embeddings
  the head shares the :class:`InputEmbedding` (a :class:`~orch.plans.parallel.stage_layers.StageLayer`
  tie), whose copy on the last stage the engine keeps equal to the first stage's.

Weights: part ``k`` (the embedding is 0, decoder layer ``i`` is ``i + 1``, the norm ``N + 1``,
an untied head ``N + 2``) is initialized by the model's own ``_init_weights`` from
``layer_seed(seed, k)``, in the pipeline and, through :func:`seed_parts`, in the model built
whole, so pp=1 and pp=2 runs of one seed start from the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from orch.plans.engines import whole_parameters
from orch.plans.errors import PipelineRefused
from orch.plans.model.meta import meta_device
from orch.plans.parallel.stage_layers import StageLayer
from orch.workloads.gpt import layer_seed


@dataclass(frozen=True)
class DecoderStructure:
    """Where the parts of a decoder LM are: attribute names on the causal LM and its base model."""

    base: str
    """The causal LM's attribute holding the base model."""
    embedding: str
    """The base model's input embedding."""
    layers: str
    """The base model's ModuleList of decoder layers."""
    norm: str
    """The base model's final norm."""
    head: str
    """The causal LM's output projection."""
    depth: int
    """Decoder layers."""
    tied: bool
    """The output projection's weight is the input embedding's."""


def _child_name(parent: nn.Module, child: nn.Module | None) -> str | None:
    return next((name for name, module in parent.named_children() if module is child), None)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def detect_structure(model: nn.Module) -> DecoderStructure:
    """The parts of ``model`` (a transformers causal LM), or :class:`PipelineRefused` saying which
    part of *embeddings -> decoder layers -> final norm -> head* it lacks."""
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model or _child_name(model, base) is None:
        raise PipelineRefused(f"{name} holds no base model (base_model_prefix) as a child")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = _child_name(model, head)
    if head_name is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise PipelineRefused(f"{name} has no output projection (get_output_embeddings()) of its own")
    others = [n for n, m in model.named_children() if n not in (prefix, head_name) and _has_parameters(m)]
    if others:
        raise PipelineRefused(f"{name} has layers outside its base model and head ({', '.join(others)})")
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    embedding_name = _child_name(base, embedding)
    if embedding_name is None or not isinstance(getattr(embedding, "weight", None), torch.Tensor):
        raise PipelineRefused(f"{type(base).__name__} has no input embedding (get_input_embeddings()) of its own")
    own = [n for n, p in base.named_parameters(recurse=False)] + [n for n, p in model.named_parameters(recurse=False)]
    if own:
        raise PipelineRefused(f"{name} has parameters outside its layers ({', '.join(own)})")
    children = list(base.named_children())
    stacks = [i for i, (_, m) in enumerate(children)
              if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(layer) for layer in m}) == 1]
    if len(stacks) != 1:
        raise PipelineRefused(f"{type(base).__name__} has {len(stacks)} lists of identical decoder layers, not one")
    position = stacks[0]
    layers_name, layers = children[position]
    after = [n for n, m in children[position + 1:] if _has_parameters(m)]
    if len(after) != 1:
        raise PipelineRefused(f"{type(base).__name__} has {len(after)} layers with parameters after its decoder "
                              f"layers ({', '.join(after) or 'none'}), not one final norm")
    tied = head.weight is embedding.weight
    if tied and any(p is not head.weight for p in head.parameters()):
        raise PipelineRefused(f"{name}'s tied output projection has parameters besides the tied weight")
    return DecoderStructure(base=prefix, embedding=embedding_name, layers=layers_name, norm=after[0],
                            head=head_name, depth=len(layers), tied=tied)


# --- the model on meta, built once per set of arguments --------------------------------------------


def _arguments_key(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, default=str)


@functools.lru_cache(maxsize=4)
def _meta_model(key: str, dtype: torch.dtype) -> tuple[nn.Module, DecoderStructure]:
    """The whole model on ``meta`` (``hf_causal_lm``'s arguments as JSON) and its structure: what
    every pipeline layer copies its part of (a deep model's layers are built one by one, each from
    this one build)."""
    from orch.workloads.hf import hf_causal_lm

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with meta_device():
            model = hf_causal_lm(**json.loads(key))
    finally:
        torch.set_default_dtype(previous)
    return model, detect_structure(model)


def _model(arguments: dict[str, Any]) -> tuple[nn.Module, DecoderStructure]:
    return _meta_model(_arguments_key(arguments), torch.get_default_dtype())


def _on_meta() -> bool:
    return torch.get_default_device().type == "meta"


def _initialize(modules: list[nn.Module], init_fn, seed: int) -> None:
    """Initialize ``modules`` in order with the model's ``_init_weights``, from ``seed``, leaving
    the global RNG as it was (under ZeRO-3, on the gathered parameters)."""
    with _gathered(modules), torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in modules:
            module.apply(init_fn)


def _gathered(modules: list[nn.Module]):
    """:func:`orch.plans.engines.whole_parameters` of every parameter of ``modules``."""
    return whole_parameters([p for m in modules for p in m.parameters()]) or contextlib.nullcontext()


def _materialize(module: nn.Module, model: nn.Module, seed: int | None, parts=None) -> nn.Module:
    """``module`` (a copy of part of the model on ``meta``) with storage on the default device and
    the model's initial values (its non-persistent buffers too, e.g. the rotary frequencies).

    ``parts(module)`` lists the modules initialized, in the order :func:`_parts` lists them in the
    model built whole (default: ``module`` itself)."""
    if _on_meta():
        return module
    module.to_empty(device=torch.get_default_device())
    modules = parts(module) if parts is not None else [module]
    _initialize(modules, model._init_weights, seed if seed is not None else torch.initial_seed())
    return module


def _without(module: nn.Module, replaced: dict[nn.Module, nn.Module]) -> nn.Module:
    """A deep copy of ``module`` in which each key of ``replaced`` is its value (not copied)."""
    return copy.deepcopy(module, memo={id(old): new for old, new in replaced.items()})


def _parts(model: nn.Module, s: DecoderStructure) -> list[list[nn.Module]]:
    """The modules of each pipeline part of the model built whole, in initialization order."""
    base = getattr(model, s.base)
    layers, norm = getattr(base, s.layers), getattr(base, s.norm)
    prelude = [m for m in base.children() if m is not layers and m is not norm]
    parts = [prelude, *[[layer] for layer in layers], [norm]]
    if not s.tied:
        parts.append([m for m in model.children() if m is not base])
    return parts


def seed_parts(model: nn.Module) -> nn.Module:
    """Give a model built whole the initial weights its pipeline layers get (see the module's
    docstring); a model that does not fit the pipeline's structure keeps its own."""
    if _on_meta():
        return model
    try:
        s = detect_structure(model)
    except PipelineRefused:
        return model
    base = torch.initial_seed()
    for index, modules in enumerate(_parts(model, s)):
        _initialize(modules, model._init_weights, layer_seed(base, index))
    return model


# --- the pipeline layers ---------------------------------------------------------------------------


class _Recorder(nn.Module):
    """Stands in for a decoder layer: keeps the arguments it is called with, passes the input on."""

    def __init__(self):
        super().__init__()
        self.call: tuple[tuple, dict] | None = None

    def forward(self, hidden_states, *args, **kwargs):
        self.call = (args, kwargs)
        return hidden_states


class _HiddenStatesIn(nn.Module):
    """Stands in for the base model under the output head: returns the hidden states it is given."""

    def forward(self, input_ids=None, *args, inputs_embeds=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as Outputs

        return Outputs(last_hidden_state=inputs_embeds)


class LayerArguments:
    """The arguments the base model's forward passes each decoder layer, computed by that forward.

    They depend on the hidden states' shape, dtype and device only (the batches carry no padding
    mask), so they are computed once per shape and shared by the stage's layers. The base model
    here has recorders for decoder layers, no input embedding (it is given the hidden states as
    ``inputs_embeds``) and no final norm; what else it holds (the rotary module, learned positions)
    is small. It is kept out of the pipeline layers' parameters: it trains nothing.
    """

    def __init__(self, model: nn.Module, s: DecoderStructure):
        base = getattr(model, s.base)
        self._model = model
        self._layers = s.layers
        self._meta = _without(base, {getattr(base, s.layers): nn.ModuleList(_Recorder() for _ in range(s.depth)),
                                     getattr(base, s.embedding): nn.Identity(), getattr(base, s.norm): nn.Identity()})
        # In eval mode: its dropout (GPT-2's after the positions) would draw from the training RNG.
        self._meta.eval()
        self._built: dict[torch.device, nn.Module] = {}
        self._last: tuple[tuple, list, torch.Tensor | None] | None = None

    def _on(self, device: torch.device) -> nn.Module:
        if device.type == "meta":
            return self._meta
        if device not in self._built:
            skeleton = copy.deepcopy(self._meta).to_empty(device=device)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                skeleton.apply(self._model._init_weights)
            self._built[device] = skeleton
        return self._built[device]

    @torch.compiler.disable
    def __call__(self, hidden: torch.Tensor, index: int, positions: torch.Tensor | None = None) -> tuple[tuple, dict]:
        """Layer ``index``'s arguments for ``hidden``; for tokens at ``positions`` of a longer
        sequence (context parallelism) given as the unpipelined model is given them
        (:func:`orch.plans.parallel.context_parallel.call_kwargs`). An engine sets one positions
        tensor for the run, so it is recognised by identity (and held, so the identity is not reused).

        Run eagerly inside a compiled layer (``plan.compile``), as the unpipelined model computes
        them outside its compiled blocks: traced, the base model's forward cannot take the
        data-dependent shortcut of an all-ones mask (plain causal attention, which context
        parallelism's split attention requires) and builds the mask for every sample of the batch
        from a mask of one row, which the compiled kernel indexes out of bounds."""
        key = (tuple(hidden.shape), hidden.dtype, hidden.device, id(positions))
        if self._last is None or self._last[0] != key:
            from orch.plans.parallel.context_parallel import call_kwargs

            skeleton = self._on(hidden.device)
            given = {} if positions is None else call_kwargs(skeleton, positions)
            with torch.no_grad():
                skeleton(inputs_embeds=hidden.detach(), use_cache=False, **given)
            self._last = (key, [recorder.call for recorder in getattr(skeleton, self._layers)], positions)
        return self._last[1][index]


@functools.lru_cache(maxsize=4)
def _layer_arguments(key: str, dtype: torch.dtype) -> LayerArguments:
    return LayerArguments(*_meta_model(key, dtype))


def _output_head(model: nn.Module, s: DecoderStructure) -> nn.Module:
    """The causal LM without its base model (on meta): its forward turns hidden states into logits."""
    return _without(model, {getattr(model, s.base): _HiddenStatesIn()})


def _logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return head(inputs_embeds=hidden, use_cache=False).logits


class InputEmbedding(nn.Module):
    """Token ids -> hidden states: the base model with no decoder layers and no final norm, run by
    its own forward. With tied embeddings it also holds the output head (sharing the weight), for
    the copy the last stage computes the logits with (:func:`tied_logits`)."""

    def __init__(self, arguments: dict[str, Any], init_seed: int | None = None):
        super().__init__()
        model, s = _model(arguments)
        base = getattr(model, s.base)
        prelude = _without(base, {getattr(base, s.layers): nn.ModuleList(), getattr(base, s.norm): nn.Identity()})
        self.base = _materialize(prelude, model, init_seed, parts=lambda m: list(m.children()))
        self.head = None
        if s.tied:
            self.head = _output_head(model, s)
            setattr(self.head, s.head, _without(getattr(model, s.head), {getattr(model, s.head).weight:
                                                                         getattr(self.base, s.embedding).weight}))

    context_positions: torch.Tensor | None = None
    """Set by an engine that splits each sample's sequence over context-parallel ranks: the
    positions of this rank's tokens in the whole sequence ([1, tokens]), for learned positions."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = {} if self.context_positions is None else {"position_ids": self.context_positions}
        return self.base(input_ids=input_ids, use_cache=False, **positions)[0]


def tied_logits(embedding: InputEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output head of the last stage: the causal LM's own logits with the embedding's weight."""
    return _logits(embedding.head, hidden)


class DecoderLayer(nn.Module):
    """Decoder layer ``index``, called with the arguments the base model's forward gives it.

    The layer is held as ``<base>.<layers>.<index>``, its path in the causal LM, so its parameters
    end in the names the model's tensor-parallel plan (regexes of those names) matches: tp x pp
    shards it.
    """

    sequence_shards: int = 1
    """Set by an engine that splits the sequence (sequence parallelism) when the hidden states reach
    this layer as one of that many slices: the arguments (positions, mask) are then computed for
    the whole sequence."""
    context_positions: torch.Tensor | None = None
    """Set by an engine that splits each sample's sequence over context-parallel ranks: the
    positions of this rank's tokens in the whole sequence ([1, tokens]), which the arguments
    (rotary angles, mask) are computed for."""

    def __init__(self, arguments: dict[str, Any], index: int, init_seed: int | None = None):
        super().__init__()
        model, s = _model(arguments)
        self.index = index
        self.path = (s.base, s.layers, str(index))
        layer = _materialize(copy.deepcopy(getattr(getattr(model, s.base), s.layers)[index]), model, init_seed)
        setattr(self, s.base, nn.ModuleDict({s.layers: nn.ModuleDict({str(index): layer})}))
        self.layer_arguments = _layer_arguments(_arguments_key(arguments), torch.get_default_dtype())

    @property
    def layer(self) -> nn.Module:
        base, layers, index = self.path
        return getattr(self, base)[layers][index]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        whole = hidden
        if self.sequence_shards > 1:
            # Only the shape, dtype and device are read: a broadcast view allocates nothing.
            shape = list(hidden.shape)
            shape[1] *= self.sequence_shards
            whole = hidden.new_empty(()).expand(shape)
        args, kwargs = self.layer_arguments(whole, self.index, self.context_positions)
        out = self.layer(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class FinalNorm(nn.Module):
    """The base model's final norm."""

    def __init__(self, arguments: dict[str, Any], init_seed: int | None = None):
        super().__init__()
        model, s = _model(arguments)
        self.norm = _materialize(copy.deepcopy(getattr(getattr(model, s.base), s.norm)), model, init_seed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class OutputHead(nn.Module):
    """Hidden states -> logits by the causal LM's own forward, its base model left out (untied head)."""

    def __init__(self, arguments: dict[str, Any], init_seed: int | None = None):
        super().__init__()
        model, s = _model(arguments)
        head = _output_head(model, s)
        stub = getattr(head, s.base)
        self.lm = _materialize(head, model, init_seed, parts=lambda m: [c for c in m.children() if c is not stub])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _logits(self.lm, hidden)


def pipeline_layers(**arguments: Any) -> list[StageLayer]:
    """``hf_causal_lm(**arguments)`` as pipeline stage layers; :class:`PipelineRefused` if the
    model does not fit *embeddings -> decoder layers -> final norm -> head*."""
    if arguments.get("pretrained_path"):
        raise PipelineRefused(f"model.pretrained_path={arguments['pretrained_path']!r}: pipeline stages are built "
                              "from model.config only (each stage would load the whole checkpoint)")
    _, s = _model(arguments)
    base = torch.initial_seed()
    tied = {"tie": "embedding", "tied_weight_attr": f"base.{s.embedding}.weight", "init_seed": layer_seed(base, 0),
            "names": {"base.": f"{s.base}.", "head.": ""}}
    layers = [StageLayer.of(InputEmbedding, arguments, **tied)]
    layers += [StageLayer.of(DecoderLayer, arguments, i, init_seed=layer_seed(base, 1 + i), names={"": ""})
               for i in range(s.depth)]
    layers.append(StageLayer.of(FinalNorm, arguments, init_seed=layer_seed(base, s.depth + 1),
                                names={"norm.": f"{s.base}.{s.norm}."}))
    if s.tied:
        layers.append(StageLayer.of(InputEmbedding, arguments, forward_fn=tied_logits, **tied))
    else:
        layers.append(StageLayer.of(OutputHead, arguments, init_seed=layer_seed(base, s.depth + 2),
                                    names={"lm.": ""}))
    return layers
