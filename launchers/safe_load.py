"""Resume without running code from the checkpoint: DeepSpeed's files loaded with ``weights_only=True``.

DeepSpeed reads every checkpoint file through ``engine.checkpoint_engine.load``, and its
``TorchCheckpointEngine`` calls ``torch.load(..., weights_only=False)``: plain unpickling, so a
file in a shared checkpoint directory could run any code in every worker. Here the engine's
``load`` is replaced, for the duration of one ``load_checkpoint``, by one that unpickles with
``weights_only=True`` and lets through only the few DeepSpeed classes its checkpoints hold.
Saving is untouched.

DeepSpeed's universal checkpoints and its converter call ``torch.load(weights_only=False)``
directly, past the engine; :func:`verified_loading` replaces ``torch.load`` itself for the
duration of a load, so those calls too get the weights-only unpickler, and every file of the
checkpoint is compared with its manifest (:mod:`launchers.manifest`) before it is unpickled.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

from plans.errors import OrchError


class UnsafeCheckpointError(OrchError):
    """A checkpoint file holds pickled objects outside the allow-list; it was not loaded."""


def deepspeed_checkpoint_globals() -> list[type]:
    """The classes DeepSpeed 0.19 pickles into checkpoints, beyond tensors and builtins.

    Found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` over checkpoints of
    ZeRO 0-3, fp32 and bf16, Adam and SGD, with and without CPU offload; and read from the
    ZeRO optimizers' ``state_dict`` (``runtime/zero/stage_1_and_2.py`` and ``stage3.py``).
    Each is plain data: an enum, a two-int dataclass, and the loss scalers (floats and ints;
    ``DynamicLossScaler`` is what fp16 on GPUs saves). The model file holds only tensors,
    ``torch.Size``, OrderedDicts and our client state (ints and a tensor).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def load_weights_only(path: str, map_location=None):
    """``torch.load`` of one checkpoint file that refuses anything but data.

    Raises :class:`UnsafeCheckpointError` naming the file and the refused globals; the
    unpickler stops at the first one, so nothing it names is ever called.
    """
    import torch

    allowed = deepspeed_checkpoint_globals()
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
            "orchestrator wrote (train.checkpoint_dir, or train.resume=never to start fresh); if a "
            "DeepSpeed upgrade saves a new class, review it and add it to "
            "launchers.safe_load.deepspeed_checkpoint_globals") from None


def refused_globals(path: str, allowed: list[type]) -> list[str] | None:
    """The globals in the file that are neither torch's safe defaults nor ours; None when torch
    cannot list them (legacy, non-zip files, or unreadable ones).

    None is "unknown", never "clean": only a weights-only load (:func:`check_data_only`) shows
    that a file holds nothing but data.
    """
    import torch

    try:
        with torch.serialization.safe_globals(allowed):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # any failure to inspect is reported as "unknown"; the caller refuses the file
        return None


def check_data_only(path: str | os.PathLike) -> None:
    """Refuse ``path`` unless the weights-only unpickler reads it whole, whatever its format.

    For a file that DeepSpeed will unpickle without ``weights_only``: legacy pickles cannot be
    inspected without unpickling, so the file is read once by the unpickler that runs no code.
    A file it cannot read (truncated, not a checkpoint) is refused too.
    """
    try:
        load_weights_only(str(path), map_location="cpu")
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
def verified_loading(folder: str | os.PathLike, *, strict: bool = True) -> Iterator[None]:
    """Within the block, every ``torch.load`` checks the file against ``folder``'s manifest, then
    unpickles it with :func:`load_weights_only`, whatever ``weights_only`` its caller passed.

    ``strict``: files outside ``folder`` are refused (a worker loads one tag directory only);
    otherwise they are read weights-only without a digest (DeepSpeed's converter re-reads its
    own intermediate files). The manifest's presence and shape are checked on entry.
    """
    import torch

    from launchers.manifest import CheckpointIntegrityError, read_manifest, sha256_of

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
        return load_weights_only(str(f), map_location=map_location)

    torch.load = guarded_load
    try:
        yield
    finally:
        torch.load = original


@contextlib.contextmanager
def weights_only_loading(engine, folder: str | os.PathLike) -> Iterator[None]:
    """Within the block, ``engine`` loads checkpoint files with :func:`load_weights_only`, each
    checked against ``folder``'s manifest (:func:`verified_loading`, which also covers the
    universal checkpoints DeepSpeed reads past the engine).

    The engine DeepSpeed configured stays in place for everything else (it decides writers,
    directories and commits), and is restored afterwards, so saves are exactly DeepSpeed's.
    """
    configured = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyEngine(configured)
    try:
        with verified_loading(folder):
            yield
    finally:
        engine.checkpoint_engine = configured


class _WeightsOnlyEngine:
    """The configured checkpoint engine with its ``load`` replaced; every other call goes through."""

    def __init__(self, configured):
        self._configured = configured

    def load(self, path: str, map_location=None):
        import torch

        return torch.load(path, map_location=map_location)  # verified_loading's, inside the block

    def __getattr__(self, name: str):
        return getattr(self._configured, name)
