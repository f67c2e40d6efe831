"""An embedded Ray for tests, started as `orch` starts one."""

from __future__ import annotations

import os

from helpers.config import REPO


def start_test_ray(num_cpus: int = 2) -> None:
    from launchers.ray_session import start_local_ray

    start_local_ray(num_cpus=num_cpus, object_store_memory=300 * 1024**2,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}})
