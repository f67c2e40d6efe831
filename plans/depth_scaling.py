"""Counting a deep model at two shallow depths and extrapolating to its real depth.

A transformer is an embedding, N identical blocks and a head. What the cost model counts on
``meta`` (FLOPs, kernel launches, the tensor-parallel all-reduce sizes, modules with parameters)
is a sum over the blocks, so it is affine in N:
``v(N) = v(d2) + (v(d2) - v(d1)) * (N - d2) / (d2 - d1)``, exact when the blocks are identical
(:func:`repeated_stack` checks). Counting GPT-3 175B's 96 blocks on ``meta`` takes seconds per
pass; at depths 2 and 4 a fraction of one. The tuner does this for models above a billion
parameters. Activation peaks are not extrapolated: a peak is a maximum over a pass, and the event
that holds it moves as the model deepens (measured: a 175B GPT's checkpointed backward peak
extrapolated from depths 2 and 4 came out at half its full count), so a straight line through two
shallow peaks can fall below the real one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from typing import TypeVar

import torch

SHALLOW_DEPTHS = (2, 4)
"""The two depths measured. Not 1: with one block, a peak can sit at a different event (the
head's backward) than it does in a deep model."""

T = TypeVar("T")


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


def shallow_copy(module: torch.nn.Module, depth: int) -> torch.nn.Module:
    """A deep copy of ``module`` whose repeated stack holds only its first ``depth`` layers.

    The other layers are left out before copying, so a 96-layer model copies two or four.
    """
    stack = repeated_stack(module)
    if stack is None:
        raise ValueError(f"{type(module).__name__} has no single stack of identical layers to cut")
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
    d1, d2 = SHALLOW_DEPTHS
    values = {}
    for field in dataclasses.fields(shallow):
        a, b = getattr(shallow, field.name), getattr(deeper, field.name)
        if field.name in keep or not isinstance(a, int) or isinstance(a, bool):
            continue
        values[field.name] = b - (-(b - a) * (depth - d2) // (d2 - d1))
    return dataclasses.replace(deeper, **values)
