"""Counting a deep model at two shallow depths and extrapolating to its real depth.

A transformer is an embedding, N identical blocks and a head. What the cost model counts on
``meta`` (FLOPs, kernel launches, the tensor-parallel all-reduce sizes, modules with parameters)
and the bytes autograd saves are sums over the blocks, so they are affine in N:
``v(N) = v(d2) + (v(d2) - v(d1)) * (N - d2) / (d2 - d1)``, exact when the blocks are identical
(:func:`repeated_stack` checks). A memory peak is a maximum, not a sum, and the event that holds
it moves as the model deepens (GPT-3 175B's checkpointed backward peak, extrapolated as a line,
came out at half its full count): :func:`peaks_at_depth` extrapolates every event of the two
shallow passes instead and takes the maximum at the real depth. Counting 175B's 96 blocks on
``meta`` takes seconds per pass, at depths 2 and 4 a fraction of one; the tuner does this for
models above a billion parameters, and ``tests/test_tune_space.py`` checks it against full counts.

A model whose config declares its depth (the built-in GPT's ``n_layer``, a Hugging Face config's
``num_hidden_layers``: :class:`DeclaredDepth`) need not be built at its real depth at all:
:class:`ShallowModels` builds it at the two shallow depths only, and every count the planner
needs is carried from there. `orch check` does so for models of
:data:`DEPTH_SCALED_FROM` layers or more, so a 2000-layer model is checked as fast as a 4-layer
one, and a model too large to build is refused from its shallow copies' arithmetic.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from orch.plans.model.meta import meta_device

SHALLOW_DEPTHS = (2, 4)
"""The two depths measured. Not 1: with one block, a peak can sit at a different event (the
head's backward) than it does in a deep model."""

DEPTH_SCALED_FROM = 16
"""Models of this many layers or more are built at :data:`SHALLOW_DEPTHS` only (when their depth
is a constructor argument); shallower ones are counted in full, which costs well under a second."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeclaredDepth:
    """How many layers a model's config gives it, where the user sets that, and the model's
    constructor arguments at any other depth: what :class:`ShallowModels` are built from.

    The built-in GPT takes its depth as an argument (``model.n_layer``); a Hugging Face model
    has it in its config (``num_hidden_layers``), given as a dict or in a ``config.json`` file.
    """

    layers: int
    field: str
    """The config field a refusal names (``model.n_layer``, ``model.config_path``)."""
    value: object
    """That field's value as declared (the depth itself, or the file that holds it)."""
    knob: str
    """What sets the depth, in words a user acts on: ``model.n_layer``, ``num_hidden_layers in PATH``."""
    setting: str
    """The depth's setting with ``{}`` for a number of layers: ``model.n_layer={}``."""
    at_depth: Callable[[int], dict]
    """The model's constructor arguments with that many layers, all else alike."""


def _signature(layer: torch.nn.Module) -> tuple:
    """What makes two layers compute the same thing: their module tree and parameter shapes."""
    return (type(layer), [(name, type(m)) for name, m in layer.named_modules()],
            [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters()])


def repeated_stack(module: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's one ModuleList of identical layers, deeper than the shallow depths; else None.

    Models with several stacks (an encoder and a decoder) or layers of different shapes are
    counted in full.
    """
    stacks = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    if len(stacks) != 1 or len(stacks[0]) <= SHALLOW_DEPTHS[-1]:
        return None
    first = _signature(stacks[0][0])
    if any(_signature(layer) != first for layer in list(stacks[0])[1:]):
        return None
    return stacks[0]


def _stack_of_depth(module: torch.nn.Module, depth: int) -> torch.nn.ModuleList | None:
    """The model's one ModuleList, when it holds exactly ``depth`` identical layers; else None."""
    stacks = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    if len(stacks) != 1 or len(stacks[0]) != depth:
        return None
    first = _signature(stacks[0][0])
    if any(_signature(layer) != first for layer in list(stacks[0])[1:]):
        return None
    return stacks[0]


def _outside_signature(module: torch.nn.Module, stack: torch.nn.ModuleList) -> tuple:
    """:func:`_signature` of the model with its stack emptied: what surrounds the layers."""
    layers = stack._modules
    stack._modules = OrderedDict()
    try:
        return _signature(module)
    finally:
        stack._modules = layers


@dataclasses.dataclass(frozen=True)
class ShallowModels:
    """A model built on ``meta`` at :data:`SHALLOW_DEPTHS` in place of its real ``depth``.

    Building a model of N layers on meta costs N times one layer's Python objects and
    initialisation: about a minute for 2000 small layers, and memory without bound for absurd
    depths. Whatever is a sum over the layers is carried to ``depth`` from the two shallow
    models instead (:meth:`at_depth`).
    """

    depth: int
    shallow: torch.nn.Module
    deeper: torch.nn.Module

    @classmethod
    def build(cls, factory_at_depth: Callable[[int], torch.nn.Module], depth: int) -> ShallowModels:
        with meta_device():
            shallow, deeper = (factory_at_depth(d) for d in SHALLOW_DEPTHS)
        return cls(depth=depth, shallow=shallow, deeper=deeper)

    @functools.cached_property
    def exact(self) -> bool:
        """Whether counts carried to ``depth`` are exact: each model holds one ModuleList of
        exactly its depth of identical layers, the same layers at both depths, and the same
        modules around them. Otherwise only estimates of the size (:meth:`at_depth`) hold."""
        a, b = (_stack_of_depth(m, d) for m, d in zip((self.shallow, self.deeper), SHALLOW_DEPTHS, strict=True))
        return (a is not None and b is not None and _signature(a[0]) == _signature(b[0])
                and _outside_signature(self.shallow, a) == _outside_signature(self.deeper, b))

    def map(self, change: Callable[[torch.nn.Module], torch.nn.Module]) -> ShallowModels:
        """The same depths with ``change`` applied to both models (e.g. their tensor-parallel shard)."""
        return ShallowModels(depth=self.depth, shallow=change(self.shallow), deeper=change(self.deeper))

    def at_depth(self, count: Callable[[torch.nn.Module], T], *, keep: tuple[str, ...] = ()) -> T:
        """``count`` (an int, or a dataclass of them) of the model at ``depth``, from the two
        shallow models: see :func:`extrapolate`."""
        a, b = count(self.shallow), count(self.deeper)
        if isinstance(a, int):
            return affine(a, b, self.depth)
        return extrapolate(a, b, self.depth, keep=keep)


def shallow_copy(module: torch.nn.Module, stack: torch.nn.ModuleList, depth: int) -> torch.nn.Module:
    """A deep copy of ``module`` whose ``stack`` (its :func:`repeated_stack`) holds only its first
    ``depth`` layers.

    The other layers are left out before copying, so a 96-layer model copies two or four.
    """
    layers = stack._modules
    stack._modules = OrderedDict(list(layers.items())[:depth])
    try:
        return copy.deepcopy(module)
    finally:
        stack._modules = layers


def extrapolate(shallow: T, deeper: T, depth: int, *, keep: tuple[str, ...] = ()) -> T:
    """The integer fields of a dataclass measured at :data:`SHALLOW_DEPTHS`, carried to ``depth``.

    Rounded up, so byte counts err towards not fitting. Fields in ``keep`` and non-integers are
    taken from the deeper measurement.
    """
    values = {}
    for field in dataclasses.fields(shallow):
        a, b = getattr(shallow, field.name), getattr(deeper, field.name)
        if field.name in keep or not isinstance(a, int) or isinstance(a, bool):
            continue
        values[field.name] = affine(a, b, depth)
    return dataclasses.replace(deeper, **values)


def affine(shallow: int, deeper: int, depth: int) -> int:
    """A count measured at :data:`SHALLOW_DEPTHS` carried along its line to ``depth``, rounded up."""
    d1, d2 = SHALLOW_DEPTHS
    return deeper - (-(deeper - shallow) * (depth - d2) // (d2 - d1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassTrace:
    """Live bytes through one forward and backward on ``meta``, and where each layer's part is.

    ``values`` holds (activation bytes, parameter-gradient bytes held) after every allocation,
    the only moments a peak can be reached. ``forward[k]`` and ``backward[k]`` are the
    [start, stop) of the repeated layer k's forward and backward in ``values``; ``forward_end``
    is where the loss has been computed.
    """

    values: list[tuple[int, int]]
    forward_end: int
    forward: list[tuple[int, int]]
    backward: list[tuple[int, int]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peaks:
    forward_peak: int
    backward_peak: int
    backward_peak_with_grads: int
    grads_at_backward_peak: int
    blocks_backward_peak: int
    later_blocks_backward_peak: int
    blocks_backward_end: int
    loss_backward_peak: int
    head_backward_peak: int


def _segments(trace: PassTrace) -> dict[str, list[tuple[int, int]]] | None:
    """The trace cut into the parts around the layers, or None when the layers' parts are not
    contiguous and, past the first layer, of one length each (then the layers do not run the same
    operations). The first may run more: sequence parallelism cuts its input, again when a
    checkpointed first layer is recomputed in backward."""
    fwd, bwd, n = trace.forward, trace.backward, len(trace.values)
    lengths = {stop - start for start, stop in fwd[1:]}, {stop - start for start, stop in bwd[1:]}
    contiguous = all(fwd[k][1] == fwd[k + 1][0] for k in range(len(fwd) - 1)) and \
        all(bwd[k + 1][1] == bwd[k][0] for k in range(len(bwd) - 1))
    ordered = 0 <= fwd[0][0] and fwd[-1][1] <= trace.forward_end <= bwd[-1][0] and bwd[0][1] <= n
    if len(lengths[0]) > 1 or len(lengths[1]) > 1 or not contiguous or not ordered:
        return None
    v = trace.values
    return {"before": v[:fwd[0][0]], "head forward": v[fwd[-1][1]:trace.forward_end],
            "head backward": v[trace.forward_end:bwd[-1][0]], "after": v[bwd[0][1]:],
            **{f"forward {k}": v[a:b] for k, (a, b) in enumerate(fwd)},
            **{f"backward {k}": v[a:b] for k, (a, b) in enumerate(bwd)}}


def _line(a: list[tuple[int, int]], b: list[tuple[int, int]], steps: float) -> list[tuple[int, int]]:
    """Each event of ``b`` moved ``steps`` times its difference from ``a``'s, rounded up."""
    return [(cb + math.ceil((cb - ca) * steps), gb + math.ceil((gb - ga) * steps))
            for (ca, ga), (cb, gb) in zip(a, b, strict=True)]


def _follows_line(parts: list[list[tuple[int, int]]]) -> bool:
    """Whether the layers' parts differ event by event by the same amount from one to the next."""
    return all(_line(parts[0], parts[1], k - 1) == parts[k] for k in range(2, len(parts)))


def head_backward_peaks(events: list[tuple[int, int]]) -> dict[str, int]:
    """``loss_backward_peak`` and ``head_backward_peak`` of the (activation, gradient) bytes from the
    loss to the repeated layers' backward: split at the first parameter gradient, whose operator's
    other outputs (the gradient of the head's input) come with it, so the event before it counts
    in both parts. Both 0 when no gradient appears there."""
    first = next((i for i, (_, grads) in enumerate(events) if grads > events[0][1]), None)
    if not first:
        return {"loss_backward_peak": 0, "head_backward_peak": 0}
    return {"loss_backward_peak": max(c for c, _ in events[:first]),
            "head_backward_peak": max(c for c, _ in events[first - 1:])}


def peaks_at_depth(shallow: PassTrace, deeper: PassTrace, depth: int) -> Peaks | None:
    """The peaks of a pass through ``depth`` layers, from passes through :data:`SHALLOW_DEPTHS`.

    Every event's bytes are affine in its layer's index and in the depth: a forward event of
    layer k holds what the k layers before it saved; a backward event of layer k holds what the
    layers below it saved and the gradients of those above it. Over the layers the maximum is
    then at the first or the last one; those, like the parts before and after the layers, move
    along a line as the model deepens. The first layer may differ from the others by what only
    it holds: a Hugging Face decoder's first layer, for one, creates tensors the later layers
    reuse, so the line is checked and carried from the second layer on and the first taken as
    measured. None when a trace breaks that pattern (then the caller counts the full depth).
    """
    d1, d2 = SHALLOW_DEPTHS
    a, b = _segments(shallow), _segments(deeper)
    if a is None or b is None or any(len(a[p]) != len(b[p]) for p in
                                     ("before", "head forward", "head backward", "after", "forward 0", "backward 0")):
        return None
    # Layers 1 .. d2-1 of the deeper pass (three of them) must lie on one line.
    forward_layers = [b[f"forward {k}"] for k in range(1, d2)]
    backward_layers = [b[f"backward {k}"] for k in range(1, d2)]
    if not (_follows_line(forward_layers) and _follows_line(backward_layers)):
        return None
    deepen = (depth - d2) / (d2 - d1)
    # Over layers 1 .. depth-1 an affine event peaks at the second layer or the last one.
    # (forward_layers[0] is layer 1: the last layer, depth - 1, lies depth - 3 steps past layer 2.)
    forward = [*b["before"], *b["forward 0"], *forward_layers[0],
               *_line(forward_layers[0], forward_layers[1], depth - 3),
               *_line(a["head forward"], b["head forward"], deepen)]
    last = _line(a[f"backward {d1 - 1}"], b[f"backward {d2 - 1}"], deepen)
    # The layer before the last lies one layer's step below it (layers 1 .. d2-1 are on a line).
    before_last = [(c + c2 - c3, g + g2 - g3) for (c, g), (c2, g2), (c3, g3)
                   in zip(last, b[f"backward {d2 - 2}"], b[f"backward {d2 - 1}"], strict=True)]
    first_layers = [*_line(a["backward 1"], b["backward 1"], deepen), *_line(a["backward 0"], b["backward 0"], deepen)]
    in_blocks = [*last, *first_layers]
    later = [*before_last, *first_layers]
    after = _line(a["after"], b["after"], deepen)
    head = _line(a["head backward"], b["head backward"], deepen)
    backward = [*head, *in_blocks, *after]
    events = forward + backward
    with_grads = max(events, key=lambda e: e[0] + e[1])
    return Peaks(forward_peak=max(c for c, _ in forward), backward_peak=max(c for c, _ in events),
                 backward_peak_with_grads=with_grads[0] + with_grads[1], grads_at_backward_peak=with_grads[1],
                 blocks_backward_peak=max((c for c, _ in in_blocks), default=0),
                 later_blocks_backward_peak=max((c for c, _ in later), default=0),
                 blocks_backward_end=(after[0] if after else in_blocks[-1])[0], **head_backward_peaks(head))
