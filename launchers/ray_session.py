"""Connect to Ray for one command: an embedded local Ray, or an existing cluster by address."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray

from plans.errors import OrchError

GIB = 1024**3


class RayConnectError(OrchError):
    """The declared Ray cluster cannot be reached."""


@contextlib.contextmanager
def ray_session(address: str | None, *, min_cpus: float = 0, object_store_gib: float = 1.0) -> Iterator[None]:
    """Yield with Ray connected; shut down only what this call started.

    An already-initialized Ray (a test fixture, a notebook) is used as it is. With no address an
    embedded Ray starts with at least ``min_cpus`` logical CPUs, so a plan may run more workers
    than cores, and a capped object store (Ray would otherwise reserve ~30% of host memory).
    """
    if ray.is_initialized():
        yield
        return
    if address is None:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)),
                 object_store_memory=int(object_store_gib * GIB), include_dashboard=False)
    else:
        try:
            ray.init(address=address)
        except (ConnectionError, RuntimeError) as exc:
            raise RayConnectError(
                f"cluster.address={address}: cannot connect to a Ray cluster there ({exc}). Fix: start the "
                "cluster (`ray start --head`), correct cluster.address, or set cluster.address=null for an "
                "embedded local Ray") from exc
    try:
        yield
    finally:
        ray.shutdown()
