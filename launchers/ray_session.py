"""Connect to Ray for one command: an embedded local Ray, or an existing cluster by address."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import ray

from plans.errors import OrchError

GIB = 1024**3
CLIENT_ATTEMPTS = 3
"""Ray client sessions tried before giving up on a ``ray://`` address."""
CLIENT_RETRY_S = 2.0
"""Pause before the second attempt, doubled before each later one."""


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
            connect(address)
        except (ConnectionError, RuntimeError) as exc:
            raise RayConnectError(
                f"cluster.address={address}: cannot connect to a Ray cluster there ({exc}). Fix: start the "
                "cluster (`ray start --head`), correct cluster.address, or set cluster.address=null for an "
                "embedded local Ray") from exc
    try:
        yield
    finally:
        ray.shutdown()


def connect(address: str) -> None:
    """``ray.init(address)``, trying a ``ray://`` address up to CLIENT_ATTEMPTS times.

    A Ray client session runs in a server process the head starts for each connection. When that
    process dies before the client reaches it (seen here when a session server left from an
    earlier cluster still held the port), Ray reports "Initialization failure from server" and
    gives up, although the next session, started on the next free port, usually works. Ray's own
    retries cover only reaching the head's proxy, not this.
    """
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    pause_s = CLIENT_RETRY_S
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address)
            return
        except ConnectionAbortedError as exc:
            if attempt == attempts:
                raise
            cause = str(exc).strip().splitlines()[-1]
            print(f"warning: {address}: the cluster could not start a client session (attempt {attempt} of "
                  f"{attempts}: {cause}); retrying in {pause_s:.0f}s", file=sys.stderr, flush=True)
            time.sleep(pause_s)
            pause_s *= 2
