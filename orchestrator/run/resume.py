"""What `orch train` settles about its checkpoint directory before any Ray resource exists:
it holds the directory for the run, and knows the model signature its checkpoints record."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from launchers.checkpoint import directory_lock, latest, model_signature
from plans.meta import meta_device
from plans.spec import ResumeMode, TrainSpec


def uses_checkpoints(train: TrainSpec) -> bool:
    """Whether the run writes or reads ``train.checkpoint_dir``."""
    return bool(train.checkpoint_every) or train.resume == ResumeMode.auto


def checkpoint_dir_lock(train: TrainSpec) -> AbstractContextManager:
    """The run's exclusive hold on ``train.checkpoint_dir`` (nothing when it uses no checkpoints).

    The directory's ``latest.json`` is read once it is held: every save reads it too (to prune),
    and a malformed one should stop the run now rather than at its first checkpoint.
    """
    if not uses_checkpoints(train):
        return contextlib.nullcontext()
    return _held(train.checkpoint_dir)


@contextlib.contextmanager
def _held(checkpoint_dir: str) -> Iterator[None]:
    with directory_lock(checkpoint_dir):
        latest(checkpoint_dir)
        yield


def signature_of(factory: Callable[[], torch.nn.Module], constructor_cfg: dict, train: TrainSpec) -> dict | None:
    """The model's signature for checkpoint manifests, read on ``meta`` (nothing allocated)."""
    if not uses_checkpoints(train):
        return None
    with meta_device():
        module = factory()
    return model_signature(module, constructor_cfg)
