"""Start-up work a training process can leave out: collector passes during imports. (The MLflow
import DeepSpeed makes for its autotuner is left out by its engine's ``import_deepspeed``.) On a
node with few cores per rank, start-up is bound by CPU time, so each second of it left out is
nearly a second sooner to the first step."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run a start-up phase with Python's cyclic garbage collector off, then freeze what survived.

    Importing torch, DeepSpeed, Ray and MLflow allocates about a million objects that live as long
    as the process. The collector runs a pass every 700 allocations and every few passes scans the
    older objects again, so a fifth of those imports' CPU time goes to passes that free nothing.

    Afterwards the survivors are frozen (``gc.freeze``) rather than handed back to the collector,
    which would otherwise scan each of them again in the next passes (a full pass over such a
    heap takes a sizeable fraction of a second, paid during training). Objects freed by reference
    counting, nearly all of them, are freed as usual meanwhile; only reference cycles made during
    start-up stay. Does nothing when the collector is already off (a caller paused it, or the
    program turned it off).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
