"""An embedded Ray for tests, started as `orch` starts one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import ray

from helpers.config import REPO
from orch.launchers.worker_pool import reusing_workers

TEST_PATHS = [str(REPO), str(REPO / "tests")]
"""Where the workers import the tests' own modules from (recording models, faulty models)."""
OBJECT_STORE_BYTES = 300 * 1024**2
_reuse = contextlib.ExitStack()
"""The shared Ray's block of worker reuse, closed (its idle workers released) with it."""
_shared_ray_up = False
"""Whether the Ray up in this process is the tests' shared one (:func:`use_shared_ray`)."""


def start_test_ray(num_cpus: int = 2) -> None:
    from orch.launchers.ray_session import start_local_ray

    start_local_ray(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(TEST_PATHS)}})


def use_shared_ray() -> None:
    """Start the tests' shared embedded Ray in this process unless a Ray is up already.

    Tests that train in this process share one Ray instead of starting one per module; a test or
    fixture that needs a Ray of its own (other settings, another environment) or none at all
    calls :func:`release_shared_ray` first. Runs on the shared Ray reuse the workers of the run
    before them when they have its shape (:mod:`orch.launchers.worker_pool`), as `orch tune`'s
    trials do: most of a short run's cost is its workers' start-up.
    """
    global _shared_ray_up
    if not ray.is_initialized():
        start_test_ray()
        _shared_ray_up = True
        _reuse.enter_context(reusing_workers())


def release_shared_ray() -> None:
    """Shut the shared Ray down when it is the Ray up in this process."""
    global _shared_ray_up
    _reuse.close()
    if _shared_ray_up and ray.is_initialized():
        ray.shutdown()
    _shared_ray_up = False


@contextlib.contextmanager
def ray_with_env(env: dict[str, str], num_cpus: int = 2) -> Iterator[None]:
    """A test Ray started where ``env`` is set (a store's endpoint and credentials): its workers
    inherit the variables, as the workers of a cluster node started with them do. The variables
    are restored and Ray shut down afterwards."""
    from orch.launchers.ray_session import start_local_ray

    release_shared_ray()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        # The tests' modules reach the workers the same way: inherited, with no runtime_env, so
        # that Ray starts each worker directly rather than through its runtime-env setup process.
        inherited = [*TEST_PATHS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        patch.setenv("PYTHONPATH", os.pathsep.join(inherited))
        start_local_ray(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES)
        try:
            yield
        finally:
            ray.shutdown()


class EnvProbe:
    """An actor that tells what its process found in its environment."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def seen(self, variable: str) -> str | None:
        return os.environ.get(variable)

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    def runtime_env(self) -> dict:
        """The runtime environment Ray started this actor's worker with (empty: none asked for)."""
        return dict(ray.get_runtime_context().runtime_env)
