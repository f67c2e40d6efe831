"""The start-up clock: each phase measured from the end of the one before, once."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from orch.run.startup import PHASES, StartupClock, describe


def test_each_phase_counts_from_the_end_of_the_last_and_only_once():
    clock = StartupClock()
    time.sleep(0.02)
    clock.mark("check")
    time.sleep(0.01)
    clock.mark("ray")
    clock.mark("ray")  # a restart reconnecting is not start-up
    assert list(clock.phases) == ["check", "ray"]
    assert clock.phases["check"] >= 0.02 and clock.phases["ray"] >= 0.01
    assert sum(clock.phases.values()) <= time.perf_counter() - clock.started


def test_the_clock_stops_at_the_first_report():
    clock = StartupClock()
    clock.mark("first_report")
    clock.mark("workers")  # a restart after training began
    assert list(clock.phases) == ["first_report"]
    assert clock.metrics() == {"startup/first_report_s": clock.phases["first_report"]}


def test_an_unknown_phase_is_a_programming_error_that_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown start-up phase 'launch'; known: imports, check, tracking, ray"):
        StartupClock().mark("launch")


def test_describe_lists_the_phases_in_the_order_they_ran():
    assert describe({"check": 2.14, "first_report": 1.0}) == "check 2.1s, first report 1.0s"
    assert list(PHASES)[-1] == "first_report"


def test_background_work_hands_back_its_result_or_its_error():
    from orch.run.startup import in_background

    with in_background(sum, [1, 2]) as result:
        assert result() == 3
    with in_background(int, "x") as result, pytest.raises(ValueError):
        result()


def test_ray_starts_in_the_background_and_lives_until_the_block_ends():
    """Ray connected by its own thread: actors placed on it get the workers' environment, Ray's
    start line is held until ready(), it is shut down when released or when the block ends, and an unreachable
    address fails ready().

    Its workers run at the command's priority (Ray would start them at nice 15).
    The environment the embedded Ray was started with is not shipped again: those actors have
    no runtime environment, so they can run in the worker processes Ray keeps idle beside its raylet. A variable it
    lacks is shipped with the actors. The command's own environment is as it was once Ray is shut down."""
    import logging

    import ray

    from helpers.config import REPO
    from helpers.ray_cluster import EnvProbe
    from orch.launchers.ray_session import RayConnectError, environment_to_ship, ray_session_in_background
    from orch.launchers.worker_group import WorkerGroupSpec, place_actors

    started_lines = []
    seen = logging.Handler()
    seen.emit = lambda record: started_lines.append(record.getMessage())
    ray_logger = logging.getLogger("ray._private.worker")
    ray_logger.addHandler(seen)
    env = {"ORCH_TEST_WORKER_ENV": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    try:
        with ray_session_in_background(None, worker_cpus=2, object_store_gib=0.25, worker_env=env) as ready:
            deadline = time.monotonic() + 120
            while not ray.is_initialized() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # Ray logs its start line as ray.init returns
            assert not [line for line in started_lines if line.startswith("Started a local Ray instance")]
            ready()
            assert [line for line in started_lines if line.startswith("Started a local Ray instance")]
            assert environment_to_ship(env) == {}
            spec = WorkerGroupSpec(world_size=2, cpus_per_worker=1, gpus_per_worker=0, env=env, wait_s=60, tp=1,
                                   strategy="PACK")
            placed = place_actors(EnvProbe, spec)
            try:
                assert ray.get([a.seen.remote("ORCH_TEST_WORKER_ENV") for a in placed.actors]) == ["1", "1"]
                # Inherited, not shipped: a runtime environment would make Ray start new worker
                # processes for these actors instead of handing them the ones it keeps idle.
                assert ray.get([a.runtime_env.remote() for a in placed.actors]) == [{}, {}]
                # The ranks run at the command's own priority, not Ray's nice 15 for workers.
                assert ray.get([a.niceness.remote() for a in placed.actors]) == [os.getpriority(os.PRIO_PROCESS, 0)] * 2
                # ...and record no Ray metrics or task events, which nothing reads from an embedded Ray.
                for name in ("RAY_enable_metrics_collection", "RAY_task_events_report_interval_ms", "RAY_event_stats"):
                    assert ray.get([a.seen.remote(name) for a in placed.actors]) == ["0", "0"], name
            finally:
                placed.release()
            shipped = {**env, "ORCH_TEST_SHIPPED": "2"}
            assert environment_to_ship(shipped) == {"ORCH_TEST_SHIPPED": "2"}
            placed = place_actors(EnvProbe, dataclasses.replace(spec, env=shipped))
            try:
                assert ray.get([a.seen.remote("ORCH_TEST_SHIPPED") for a in placed.actors]) == ["2", "2"]
                assert ray.get([a.seen.remote("ORCH_TEST_WORKER_ENV") for a in placed.actors]) == ["1", "1"]
            finally:
                placed.release()
            # Released, Ray stops while the block goes on (the command logs its model meanwhile).
            ready.release()
            deadline = time.monotonic() + 60
            while ray.is_initialized() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not ray.is_initialized(), "a released Ray was not shut down before the block ended"
            with pytest.raises(RuntimeError, match="released"):
                ready()
    finally:
        ray_logger.removeHandler(seen)
    assert not ray.is_initialized()
    assert environment_to_ship(env) == env and "ORCH_TEST_WORKER_ENV" not in os.environ, \
        "a session's environment outlived it"
    with ray_session_in_background("127.0.0.1:1", connect_timeout_s=1) as ready, pytest.raises(RayConnectError):
        ready()


def test_a_block_that_fails_while_ray_starts_does_not_wait_for_it():
    """The command's error comes at once; the Ray it was starting is shut down by its thread, and
    the next session in the process waits for that instead of finding a Ray about to stop."""
    import ray

    from orch.launchers.ray_session import ray_session, ray_session_in_background

    started = time.monotonic()
    with pytest.raises(KeyError), ray_session_in_background(None, worker_cpus=2, object_store_gib=0.25):
        raise KeyError("a refusal")
    assert time.monotonic() - started < 1.0, "the failing block waited for Ray's start"
    with ray_session(None, worker_cpus=2, object_store_gib=0.25):
        assert ray.cluster_resources().get("CPU", 0) >= 2
    assert not ray.is_initialized()


# --- the embedded Ray started before torch is imported (orch/run/early_ray.py) -------------------

@pytest.mark.parametrize("override", [
    "cluster.address=127.0.0.1:1",  # a cluster joined by address: connected to later, as before
    "data=ray",  # a source with Ray tasks of its own: its CPUs are known only once it is built
    "plan.tp=3",  # wrong plan arithmetic: refused before any Ray starts
    "train.steps=0",  # a declared value out of range: the same
])
def test_ray_is_not_started_early_for_runs_it_cannot_size_or_that_will_be_refused(override):
    from helpers.config import compose_config
    from orch.config import to_typed
    from orch.run.early_ray import early_ray

    typed, _, _ = to_typed(compose_config(override))
    with early_ray(typed) as ready:
        assert ready is None


def test_ray_starts_early_without_torch_imported():
    """In a fresh interpreter, as `orch train` runs: the default run's Ray starts before torch is
    imported, then the driver is imported beside it; Ray comes up sized by the plan (two workers'
    CPUs) and with the workers' environment, and is shut down when the start-up's block ends."""
    import subprocess
    import sys

    code = ("import os, sys\n"
            "sys.path.insert(0, 'tests')\n"
            "from helpers.config import compose_config\n"
            "from orch.config import to_typed\n"
            "from orch.run.startup import Startup\n"
            "typed, _, _ = to_typed(compose_config('cluster.object_store_memory_gib=0.1'))\n"
            "with Startup.for_command(typed) as startup:\n"
            "    assert 'torch' not in sys.modules, 'torch was imported'\n"
            "    import ray\n"
            "    assert startup.ray_ready is not None, 'Ray was not started early'\n"
            "    driver = startup.driver()\n"
            "    assert 'torch' in sys.modules and list(startup.clock.phases) == ['imports']\n"
            "    assert startup.ray_ready()\n"
            "    assert ray.cluster_resources()['CPU'] >= 2\n"
            "    assert os.environ.get('DS_ACCELERATOR') == 'cpu'\n"
            "assert not ray.is_initialized()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # the session sets it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
