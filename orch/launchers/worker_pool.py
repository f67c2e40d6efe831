"""Worker processes kept from one run to the next run of the same driver.

A run's fixed cost is mostly its workers' processes: Ray starts each one, and before its first
step it imports torch, DeepSpeed and, through ``torch.optim`` and DeepSpeed's optimizers, torch's
compiler stack: about 4-5 s of CPU per worker on a CPU worker here, each run. Drivers that train
one run after another on the same devices (``orch tune``'s trials, ``orch calibrate``'s reference
runs) pay it every time. Within :func:`reusing_workers`, a worker group whose run finished
cleanly resets its actors (:meth:`orch.launchers.worker.TrainWorker.reset`) and leaves them here,
placement group and all, and the next group of the same shape takes them instead of starting new
processes. Ray Tune's ``reuse_actors`` is the precedent.

Idle workers still hold their devices, so the pool keeps at most one idle group: placing any
other actors (:func:`orch.launchers.worker_group.place_actors`) releases it first, and so does
the end of the block. A group is kept only when every actor reset itself; a failed, hung or stopped
run's workers are killed as before, so no state of a broken run reaches the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

PING_TIMEOUT_S = 10.0
"""How long a pooled group's actors have to answer before the pool gives up on them."""


@dataclass(frozen=True)
class _Idle:
    job_id: str
    """The Ray job (driver connection) that owns the actors: they die with it."""
    actor_class: type
    spec: Any
    """The :class:`orch.launchers.worker_group.WorkerGroupSpec` the group was placed for."""
    placed: Any
    """Its :class:`orch.launchers.worker_group.PlacedActors`, with their final rank slots."""


_depth = 0
"""How many :func:`reusing_workers` blocks are open."""
_idle: _Idle | None = None


@contextlib.contextmanager
def reusing_workers() -> Iterator[None]:
    """Keep the workers of each cleanly finished group for the next group of the same shape while
    this block runs. Blocks nest; the end of each releases the idle group, so that a command's
    last trial frees its devices when the command is done with them."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        release_idle()


def pooling() -> bool:
    """Whether a finished group should offer its workers to the pool."""
    return _depth > 0


def _current_job() -> str | None:
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


def take(actor_class: type, spec: Any) -> Any | None:
    """The idle group's placed actors when they were placed for ``spec`` by this Ray job and still
    answer; otherwise ``None``, and whatever was idle is released."""
    global _idle
    idle, _idle = _idle, None
    if idle is None:
        return None
    if idle.job_id == _current_job() and idle.actor_class is actor_class and idle.spec == spec:
        try:
            ray.get([actor.node_id.remote() for actor in idle.placed.actors], timeout=PING_TIMEOUT_S)
            return idle.placed
        except Exception:  # noqa: BLE001 - a worker that died while idle: the group is placed anew
            pass
    _release(idle)
    return None


def keep(actor_class: type, spec: Any, placed: Any) -> None:
    """Hold ``placed`` (reset actors) for the next group of ``spec``'s shape, releasing any other."""
    global _idle
    release_idle()
    _idle = _Idle(_current_job() or "", actor_class, spec, placed)


def release_idle() -> None:
    """Kill the idle group's actors and free its devices (nothing when none is idle)."""
    global _idle
    idle, _idle = _idle, None
    if idle is not None:
        _release(idle)


def _release(idle: _Idle) -> None:
    # Actors of a Ray that has shut down died with it; their placement group went too.
    if ray.is_initialized() and idle.job_id == _current_job():
        with contextlib.suppress(Exception):
            idle.placed.release()
