"""DeepSpeed checkpoints written in the background (``train.async_checkpoint``).

DeepSpeed's own asynchronous writers do not serve here: the decoupled engine
(``checkpoint.writer.decoupled``) and FastPersist need the ``async_io`` op, built against libaio
and meant for NVMe, and they commit at DeepSpeed's next optimizer step rather than when the loop
publishes. What DeepSpeed does offer is its checkpoint-engine seam: ``save_checkpoint`` hands every
file it writes (model states, ZeRO partitions, pipeline layers) to ``engine.checkpoint_engine.save``.
During one save the configured engine is wrapped so that ``save`` only copies the state to host
memory (DeepSpeed's ``clone_tensors_for_torch_save``); a thread then writes the copies through the
configured engine's own ``save``, in the format DeepSpeed would have written in the step.
The loop publishes the checkpoint (its manifest) only after the thread is done on every rank
(:class:`orch.launchers.checkpoint_io.CheckpointIO`), so a crash mid-write leaves the previous
checkpoint the latest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class _HostCopyEngine:
    """The configured checkpoint engine with ``save`` replaced by a copy to host memory, queued."""

    def __init__(self, configured):
        self.configured = configured
        self.queued: list[tuple[Any, str]] = []

    def save(self, state_dict, path: str) -> None:
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

        self.queued.append((clone_tensors_for_torch_save(state_dict), path))

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed clones views before a save when the engine keeps storage sharing; the copy
        # above already is one, compact, so a second is not needed.
        return False

    def is_decoupled(self) -> bool:
        return False  # DeepSpeed commits in the save itself; publishing is the loop's

    def __getattr__(self, name: str):
        return getattr(self.configured, name)


@contextlib.contextmanager
def host_copies(engine) -> Iterator[_HostCopyEngine]:
    """Within the block, ``engine.save_checkpoint`` copies each file's state to host memory
    instead of writing it; the copies and their paths are the yielded engine's ``queued``."""
    configured = engine.checkpoint_engine
    copying = _HostCopyEngine(configured)
    engine.checkpoint_engine = copying
    try:
        yield copying
    finally:
        engine.checkpoint_engine = configured


def write_in_background(configured, queued: list[tuple[Any, str]]) -> Callable[[], None]:
    """Write ``queued`` (state, path) pairs with ``configured.save`` on a thread; return the wait,
    which raises what the writing raised."""
    failed: list[BaseException] = []

    def write() -> None:
        try:
            for state, path in queued:
                configured.save(state, path)
        except BaseException as error:  # handed to the waiting loop, which reports it
            failed.append(error)
        finally:
            queued.clear()  # the host copies go as soon as they are on disk

    thread = threading.Thread(target=write, name="orch-deepspeed-checkpoint", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait
