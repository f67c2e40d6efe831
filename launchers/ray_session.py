"""Connect to Ray for one command: an embedded local Ray, or an existing cluster by address."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import ray

GIB = 1024**3


def _use_token_auth_if_available() -> None:
    """Send the cluster's auth token when one is on this machine.

    Ray 2.60's ``ray start`` enables token authentication and saves the token in
    ``~/.ray/auth_token``, but a client only sends it when ``RAY_AUTH_MODE=token``; without it,
    joining a local ``ray start`` cluster fails with InvalidAuthToken. A user's explicit
    ``RAY_AUTH_MODE`` always wins.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH", os.path.expanduser("~/.ray/auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


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
        ray.init(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)),
                 object_store_memory=int(object_store_gib * GIB), include_dashboard=False)
    else:
        _use_token_auth_if_available()
        ray.init(address=address)
    try:
        yield
    finally:
        ray.shutdown()
