"""DeepSpeed's checkpoint files read without running code: the classes its checkpoints pickle,
and its engine's loads routed through the weights-only unpickler (:mod:`orch.launchers.safe_load`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from orch.launchers.safe_load import verified_loading


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


def ds_verified_loading(folder: str | os.PathLike, *, strict: bool = True) -> contextlib.AbstractContextManager:
    """:func:`verified_loading` with DeepSpeed's allow-list (:func:`deepspeed_checkpoint_globals`)."""
    return verified_loading(folder, deepspeed_checkpoint_globals(), strict=strict)


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
        with ds_verified_loading(folder):
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
