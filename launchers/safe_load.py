"""Resume without running code from the checkpoint: DeepSpeed's files loaded with ``weights_only=True``.

DeepSpeed reads every checkpoint file through ``engine.checkpoint_engine.load``, and its
``TorchCheckpointEngine`` calls ``torch.load(..., weights_only=False)``: plain unpickling, so a
file in a shared checkpoint directory could run any code in every worker. Here the engine's
``load`` is replaced, for the duration of one ``load_checkpoint``, by one that unpickles with
``weights_only=True`` and lets through only the few DeepSpeed classes its checkpoints hold.
Saving is untouched.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

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
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = refused_globals(path, allowed)
        what = (f"holds pickled objects that could run code when loaded: {', '.join(refused)}" if refused
                else f"was refused by the weights-only unpickler ({_unpickler_complaint(error)})")
        raise UnsafeCheckpointError(
            f"checkpoint file {path} {what}. It was not loaded. Fix: resume only from checkpoints this "
            "orchestrator wrote (train.checkpoint_dir, or train.resume=never to start fresh); if a "
            "DeepSpeed upgrade saves a new class, review it and add it to "
            "launchers.safe_load.deepspeed_checkpoint_globals") from None


def refused_globals(path: str, allowed: list[type]) -> list[str]:
    """The globals in the file that are neither torch's safe defaults nor ours (zip format only)."""
    import torch

    try:
        with torch.serialization.safe_globals(allowed):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # legacy (non-zip) files cannot be inspected; the unpickler's message is used
        return []


def _unpickler_complaint(error: Exception) -> str:
    """The line of torch's long weights-only message that says what was refused."""
    for line in str(error).splitlines():
        if "unsupported" in line.lower():
            return line.split("WeightsUnpickler error:")[-1].split(" Please use")[0].strip()
    return str(error).strip()


@contextlib.contextmanager
def weights_only_loading(engine) -> Iterator[None]:
    """Within the block, ``engine`` loads checkpoint files with :func:`load_weights_only`.

    The engine DeepSpeed configured stays in place for everything else (it decides writers,
    directories and commits), and is restored afterwards, so saves are exactly DeepSpeed's.
    """
    if engine.load_universal_checkpoint():
        # Universal checkpoints are read with torch.load(weights_only=False) directly inside
        # the ZeRO optimizers, past the checkpoint engine: they cannot be loaded safely here.
        raise UnsafeCheckpointError("checkpoint.load_universal=true in the DeepSpeed config: universal "
                                    "checkpoints are unpickled without weights_only. Fix: drop it from the config")
    configured = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyEngine(configured)
    try:
        yield
    finally:
        engine.checkpoint_engine = configured


class _WeightsOnlyEngine:
    """The configured checkpoint engine with its ``load`` replaced; every other call goes through."""

    def __init__(self, configured):
        self._configured = configured

    def load(self, path: str, map_location=None):
        return load_weights_only(path, map_location=map_location)

    def __getattr__(self, name: str):
        return getattr(self._configured, name)
