"""Resume without running code from the checkpoint: files loaded with ``weights_only=True``,
each checked against the checkpoint's manifest first.

``torch.load(..., weights_only=False)`` is plain unpickling, so a file in a shared checkpoint
directory could run any code in every worker. :func:`load_weights_only` unpickles with
``weights_only=True`` and lets through only the plain-data classes its caller allows: each engine
passes the few its checkpoints hold (DeepSpeed's are in
:mod:`orch.launchers.engines.deepspeed.checkpoint_files`, which also routes DeepSpeed's engine's
own loads here). This module knows no engine.

DeepSpeed's universal checkpoints and its converter call ``torch.load(weights_only=False)``
directly, past the engine; :func:`verified_loading` replaces ``torch.load`` itself for the
duration of a load, so those calls too get the weights-only unpickler, and every file of the
checkpoint is compared with its manifest (:mod:`orch.launchers.manifest`) before it is unpickled.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

from orch.plans.errors import OrchError


class UnsafeCheckpointError(OrchError):
    """A checkpoint file holds pickled objects outside the allow-list; it was not loaded."""


def load_weights_only(path: str, allowed: list, map_location=None):
    """``torch.load`` of one checkpoint file that refuses anything but data and the classes in
    ``allowed`` (the loading engine's allow-list).

    Raises :class:`UnsafeCheckpointError` naming the file and the refused globals; the
    unpickler stops at the first one, so nothing it names is ever called.
    """
    import torch

    allowed = with_enum_members_by_name(allowed)
    try:
        with torch.serialization.safe_globals(allowed):
            # torch.serialization.load, not torch.load: within verified_loading torch.load is ours.
            return torch.serialization.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = refused_globals(path, allowed)
        what = (f"holds pickled objects that could run code when loaded: {', '.join(refused)}" if refused
                else f"was refused by the weights-only unpickler ({_unpickler_complaint(error)})")
        raise UnsafeCheckpointError(
            f"checkpoint file {path} {what}. It was not loaded. Fix: resume only from checkpoints this "
            "orchestrator wrote (train.checkpoint_dir, or train.resume=never to start fresh); if an "
            "upgrade of the engine saves a new class, review it and add it to that engine's allow-list "
            "(DeepSpeed's: orch.launchers.engines.deepspeed.checkpoint_files.deepspeed_checkpoint_globals)") from None


def with_enum_members_by_name(allowed: list) -> list:
    """``allowed``, plus the one form of ``builtins.getattr`` some Pythons pickle an Enum member as.

    Python 3.11.0-3.11.3 (Debian 12's 3.11.2 among them) pickle a member of an Enum with a mixed-in
    type, such as DeepSpeed's ``ZeroStageEnum(int, Enum)``, as ``getattr(ZeroStageEnum, "gradients")``
    instead of ``ZeroStageEnum(2)``. Allowing ``getattr`` itself would let a file fetch any attribute
    of an allowed class; torch's allow-list takes a stand-in for a global instead (the
    ``(callable, "module.name")`` form), so ``builtins.getattr`` is bound to a function that returns
    exactly a member of one of ``allowed``'s Enums, by its name, and refuses anything else.
    """
    enums = tuple(c for c in allowed if isinstance(c, type) and issubclass(c, enum.Enum))
    if not enums:
        return allowed

    def enum_member(owner, name):
        if owner in enums and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        raise pickle.UnpicklingError(f"Unsupported getattr({owner!r}, {name!r}): only a member of an allowed "
                                     "Enum is fetched by name")

    return [*allowed, (enum_member, "builtins.getattr")]


def refused_globals(path: str, allowed: list[type]) -> list[str] | None:
    """The globals in the file that are neither torch's safe defaults nor ours; None when torch
    cannot list them (legacy, non-zip files, or unreadable ones).

    None is "unknown", never "clean": only a weights-only load (:func:`check_data_only`) shows
    that a file holds nothing but data.
    """
    import torch

    try:
        with torch.serialization.safe_globals(with_enum_members_by_name(allowed)):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # any failure to inspect is reported as "unknown"; the caller refuses the file
        return None


def check_data_only(path: str | os.PathLike, allowed: list) -> None:
    """Refuse ``path`` unless the weights-only unpickler reads it whole, whatever its format.

    For a file that DeepSpeed will unpickle without ``weights_only``: legacy pickles cannot be
    inspected without unpickling, so the file is read once by the unpickler that runs no code.
    A file it cannot read (truncated, not a checkpoint) is refused too.
    """
    try:
        load_weights_only(str(path), allowed, map_location="cpu")
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # unreadable means unverified: refused, never trusted
        raise UnsafeCheckpointError(
            f"checkpoint file {path} could not be verified ({type(error).__name__}: {str(error)[:200]}). It was not "
            "loaded. Fix: resume only from checkpoints this orchestrator wrote, or train.resume=never to start "
            "fresh") from None


def _unpickler_complaint(error: Exception) -> str:
    """The line of torch's long weights-only message that says what was refused."""
    for line in str(error).splitlines():
        if "unsupported" in line.lower():
            return line.split("WeightsUnpickler error:")[-1].split(" Please use")[0].strip()
    return str(error).strip()


@contextlib.contextmanager
def verified_loading(folder: str | os.PathLike, allowed: list, *, strict: bool = True) -> Iterator[None]:
    """Within the block, every ``torch.load`` checks the file against ``folder``'s manifest, then
    unpickles it with :func:`load_weights_only` and ``allowed``, whatever ``weights_only`` its
    caller passed.

    ``strict``: files outside ``folder`` are refused (a worker loads one tag directory only);
    otherwise they are read weights-only without a digest (DeepSpeed's converter re-reads its
    own intermediate files). The manifest's presence and shape are checked on entry.
    """
    import torch

    from orch.launchers.manifest import CheckpointIntegrityError, read_manifest, sha256_of

    manifest = read_manifest(folder)
    original = torch.load

    def guarded_load(f, map_location=None, **_ignored):
        if not isinstance(f, (str, os.PathLike)):
            raise UnsafeCheckpointError(f"a checkpoint load read from {type(f).__name__}, not a file: refused")
        inside = Path(os.path.realpath(f)).is_relative_to(os.path.realpath(manifest.folder))
        if inside or strict:
            if sha256_of(f) != manifest.digest_of(f):
                raise CheckpointIntegrityError(
                    f"checkpoint file {f} does not match its digest in {manifest.folder}/manifest.json (changed "
                    "since it was verified); it was not loaded. Fix: resume only from checkpoints this orchestrator "
                    "wrote, or train.resume=never to start fresh")
        return load_weights_only(str(f), allowed, map_location=map_location)

    torch.load = guarded_load
    try:
        yield
    finally:
        torch.load = original
