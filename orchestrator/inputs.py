"""Every declared value checked before anything starts: ranges, the corpus and the checkpoint directory.

The pure range rules live in :mod:`plans.validate`; this module adds what needs the file system
(the driver's view of it: it reads ``latest.json`` of the same checkpoint directory to resume,
and the workers of a multi-node cluster share the path). :func:`validated_plan` reports all of
them together with the plan's own problems, in one :class:`PlanError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from pathlib import Path

from orchestrator.config import RunConfig
from plans.errors import PlanError, Violation
from plans.resolve import ResolvedPlan, resolve_plan
from plans.spec import ClusterSpec, DataSpec, ResumeMode, TrainSpec
from plans.validate import field_violations
from workloads.corpus import byte_count, split_sizes, window_count

_CORPUS_FIX = "point data.path at a text file (optionally .gz), or set data.path=null for the shipped corpus"


def input_violations(cfg: RunConfig) -> list[Violation]:
    """Every declared value that cannot work, whatever the plan: ranges, corpus, checkpoint directory."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model"}
    found = field_violations(sections)
    sizes_valid = not {v.field for v in found} & {"data.seq_len", "data.val_fraction"}
    return found + corpus_violations(cfg.data, windows=1 if sizes_valid else 0) + checkpoint_dir_violations(cfg.train)


def check_inputs(cfg: RunConfig) -> None:
    """Raise :class:`PlanError` with :func:`input_violations`, if there are any."""
    found = input_violations(cfg)
    if found:
        raise PlanError(found)


def validated_plan(cfg: RunConfig, cluster: ClusterSpec) -> ResolvedPlan:
    """The resolved plan, or one :class:`PlanError` with the plan's problems and the inputs' together."""
    found = input_violations(cfg)
    try:
        plan = resolve_plan(cfg.plan, cluster, cfg.train)
    except PlanError as error:
        found += error.violations
    if found:
        raise PlanError(found)
    return plan


def corpus_violations(data: DataSpec, *, windows: int) -> list[Violation]:
    """The corpus must exist, be readable and give ``windows`` samples to both training and evaluation.

    ``windows=1`` is what any run needs; a step of the plan needs ``dp * micro_batch_size``
    (:func:`corpus_fits_plan`). With ``windows=0`` only the file is checked (data.seq_len or
    data.val_fraction out of range leave no size to check against).
    """
    shown = data.path if data.path else "the shipped corpus"
    if data.path:
        path = Path(data.path)
        if not path.exists():
            return [Violation("data.path", data.path, "no such file.", _CORPUS_FIX)]
        if not path.is_file():
            return [Violation("data.path", data.path, "is not a regular file (a directory?).", _CORPUS_FIX)]
    if windows < 1:
        return []
    window_bytes = windows * data.seq_len + 1
    # Both parts of the split need window_bytes; reading more than this proves nothing more.
    enough = math.ceil(window_bytes / min(data.val_fraction, 1 - data.val_fraction)) + 2
    try:
        n_bytes = byte_count(data.path, enough)
    # Unreadable, not gzip at all (gzip.BadGzipFile is an OSError), truncated (EOFError) or corrupt (zlib.error).
    except (OSError, EOFError, zlib.error) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error) or type(error).__name__
        return [Violation("data.path", shown, f"cannot be read: {reason}.", _CORPUS_FIX)]
    n_train, n_val = split_sizes(n_bytes, data.val_fraction)
    train_windows, val_windows = window_count(n_train, data.seq_len), window_count(n_val, data.seq_len)
    if train_windows >= windows and val_windows >= windows:
        return []
    arithmetic = (f"its {n_bytes:,} bytes split by data.val_fraction={data.val_fraction:g} into {n_train:,} "
                  f"training and {n_val:,} evaluation bytes give {train_windows} and {val_windows} windows of "
                  f"data.seq_len + 1 = {data.seq_len + 1} bytes; each part needs {windows}")
    if train_windows >= windows:
        return [Violation("data.val_fraction", data.val_fraction, f"the evaluation part of {shown} is too small: "
                          f"{arithmetic}.", "raise data.val_fraction, use a larger corpus or a smaller data.seq_len")]
    return [Violation("data.path", shown, f"the corpus is too small: {arithmetic}.",
                      f"use a larger corpus, or a smaller data.seq_len; {_CORPUS_FIX}")]


def corpus_fits_plan(data: DataSpec, plan: ResolvedPlan) -> None:
    """Raise :class:`PlanError` unless every data-parallel rank gets a micro-batch of both parts of
    the corpus (ranks of one replica, across tp and pp, read the same batch)."""
    found = corpus_violations(data, windows=plan.dp * plan.micro_batch_size)
    if found:
        fix = (f"{found[0].fix}; or lower plan.micro_batch_size({plan.micro_batch_size}) or the data-parallel "
               f"degree dp({plan.dp}): each step draws dp * micro_batch_size = "
               f"{plan.dp * plan.micro_batch_size} windows per part")
        raise PlanError([dataclasses.replace(found[0], fix=fix)])


def checkpoint_dir_violations(train: TrainSpec) -> list[Violation]:
    """A checkpoint directory that will be written must be a directory this user can write, or be
    creatable in one; one that is only read (resume) must not be a file."""
    writes = train.checkpoint_every > 0
    if not writes and train.resume != ResumeMode.auto:
        return []
    path = Path(train.checkpoint_dir)
    if path.exists() and not path.is_dir():
        return [Violation("train.checkpoint_dir", train.checkpoint_dir, "is a file, not a directory.",
                          "point train.checkpoint_dir at a directory (it is created if missing)")]
    if not writes:
        return []
    existing = next((p for p in [path, *path.absolute().parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == path else f"its closest existing parent {existing}"
        return [Violation("train.checkpoint_dir", train.checkpoint_dir,
                          f"checkpoints cannot be written there: {where} is not a directory this user can write.",
                          "point train.checkpoint_dir at a writable directory, or set train.checkpoint_every=0")]
    return []
