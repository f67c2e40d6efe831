"""What `orch train` settles about its checkpoint directory before any Ray resource exists:
it holds the directory for the run, and knows the model signature its checkpoints record.

torch is imported only to sign the model: `orch train` asks :func:`refuse_unusable_checkpoint_dir`
before it imports torch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from orch.declared import declared_and_plan_violations
from orch.launchers.checkpoint import (
    CheckpointDirError,
    CheckpointRecordError,
    directory_lock,
    latest,
    model_signature,
    refuse_held_or_malformed,
)
from orch.plans.errors import PlanError
from orch.plans.spec import ResumeMode, TrainSpec

if TYPE_CHECKING:
    import torch

    from orch.config import RunConfig


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


def refuse_unusable_checkpoint_dir(cfg: RunConfig) -> None:
    """Refuse, before torch is imported or Ray starts, a ``train.checkpoint_dir`` that
    :func:`checkpoint_dir_lock` would refuse (another run holds it; its ``latest.json`` is malformed).

    The run checks its declared values, plan and model before it takes the directory, so problems
    with those are reported first, all together, here too.
    """
    if not uses_checkpoints(cfg.train):
        return
    try:
        refuse_held_or_malformed(cfg.train.checkpoint_dir)
    except (CheckpointDirError, CheckpointRecordError):
        if violations := declared_and_plan_violations(cfg):
            raise PlanError(violations) from None
        raise


@contextlib.contextmanager
def _held(checkpoint_dir: str) -> Iterator[None]:
    with directory_lock(checkpoint_dir):
        latest(checkpoint_dir)
        yield


def signature_of(factory: Callable[[], torch.nn.Module], constructor_cfg: dict, train: TrainSpec) -> dict | None:
    """The model's signature for checkpoint manifests, read on ``meta`` (nothing allocated)."""
    if not uses_checkpoints(train):
        return None
    from orch.plans.model.meta import meta_device

    with meta_device():
        module = factory()
    return model_signature(module, constructor_cfg)
