"""Building a model on ``meta``, where it has shapes and dtypes but no storage.

The planner builds the user's model on ``meta`` to count it. Its constructor still runs its
weight initializers, and on ``meta`` the random ones (``normal_``, ``uniform_``, ...) go through
torch's Python reference implementations, whose first use imports TorchDynamo: a second or more
of every command's start-up, spent drawing numbers into tensors that hold none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_INITIALIZERS = frozenset(
    {getattr(torch.nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")}
    | {getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_", "bernoulli_")})
"""torch's weight initializers and in-place random fills: what a constructor calls to set values."""


class _SkipInitializers(TorchFunctionMode):
    """Return a ``meta`` tensor from an initializer unchanged; everything else runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """``torch.device("meta")`` for building a model: tensors are created on ``meta`` and the
    constructor's initializers are skipped (their values would not exist anyway)."""
    with torch.device("meta"), _SkipInitializers():
        yield
