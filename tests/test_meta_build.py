"""The planner's model on ``meta``: built once per command, initializers skipped."""

from __future__ import annotations

import pickle

import pytest
import torch

from orch.models import model_factory
from orch.plans.model.meta import meta_device

BUILDS = []


class Counted(torch.nn.Module):
    """A model that counts its constructions and initializes the way real ones do."""

    def __init__(self, width: int = 8, std: float = 0.02):
        super().__init__()
        BUILDS.append(width)
        self.proj = torch.nn.Linear(width, width)
        self.table = torch.nn.Embedding(4, width)
        torch.nn.init.normal_(self.proj.weight, 0.0, std)
        self.table.weight.data.normal_(0.0, std)

    def forward(self, x):
        return self.proj(x)


CFG = {"_target_": f"{__name__}.Counted", "width": 8}


def test_initializers_are_skipped_on_meta_and_run_for_real():
    """An initializer that runs fails here (a negative std): on meta it is never called."""
    with pytest.raises(RuntimeError, match="normal expects std >= 0.0"), torch.device("meta"):
        Counted(std=-1.0)
    with meta_device():
        module = Counted(std=-1.0)
    assert module.proj.weight.is_meta and module.proj.weight.shape == (8, 8)
    assert Counted().table.weight.std() > 0  # for real, initialized as the model says


def test_the_factory_builds_once_on_meta_and_hands_out_independent_copies():
    factory = model_factory(CFG)
    BUILDS.clear()
    with meta_device():
        first, second = factory(), factory()
    assert BUILDS == [8]
    assert first is not second and first.proj.weight is not second.proj.weight
    first.proj.weight.grad = torch.empty(8, 8, device="meta")  # a backward pass on one copy ...
    first.to(torch.bfloat16)  # ... or a cast leaves the other as built
    assert second.proj.weight.grad is None and second.proj.weight.dtype == torch.float32
    with meta_device():
        torch.set_default_dtype(torch.bfloat16)
        try:
            assert factory().proj.weight.dtype == torch.bfloat16  # built again under another default dtype
        finally:
            torch.set_default_dtype(torch.float32)
    assert BUILDS == [8, 8]


def test_real_builds_are_never_cached_and_the_cache_is_not_pickled():
    factory = model_factory(CFG)
    BUILDS.clear()
    with meta_device():
        factory()
    copy = pickle.loads(pickle.dumps(factory))
    assert copy.model_cfg == CFG and not copy._on_meta
    assert not factory().proj.weight.is_meta and not factory().proj.weight.is_meta
    assert BUILDS == [8, 8, 8]


class Uncopyable(Counted):
    def __deepcopy__(self, memo):
        raise TypeError("holds a handle")


def test_a_model_that_cannot_be_deep_copied_is_built_each_time():
    factory = model_factory({**CFG, "_target_": f"{__name__}.Uncopyable"})
    BUILDS.clear()
    with meta_device():
        first, second = factory(), factory()
    assert first is not second and BUILDS == [8, 8]
