"""`orch train`'s start-up steps (orch.run.startup.Startup): what each one starts, waits
for and marks, on an embedded Ray's ``ready()`` the caller already holds."""

from __future__ import annotations

import gc
import sys

import pytest

from helpers.config import compose_config
from orch.config import to_typed
from orch.plans.resolve import resolve_plan
from orch.run.startup import TRACKING_MODULE, Startup


class ReadyCalls:
    """An early Ray's ``ready(wait=...)`` that is up at once, recording how it was asked."""

    def __init__(self):
        self.waits: list[bool] = []
        self.released = False

    def __call__(self, wait: bool = True) -> bool:
        self.waits.append(wait)
        return True

    def release(self) -> None:
        self.released = True


def test_the_steps_overlap_the_imports_take_ray_then_wait_for_it_and_mark_each_phase():
    typed, _, _ = to_typed(compose_config())
    ready = ReadyCalls()
    assert gc.isenabled()
    with Startup(typed, ray_ready=ready) as startup:
        assert not gc.isenabled(), "start-up runs with the collector paused"
        startup.inputs_valid(resolve_plan(typed.plan, typed.cluster, typed.train), data_cpus=0.0)
        assert startup.ray_ready is ready, "a Ray the caller started is not started again"
        assert startup.tracking_module() is sys.modules[TRACKING_MODULE]
        startup.checked()
        assert ready.waits == [False], "Ray is taken without waiting once the checks pass"
        startup.tracked()
        startup.ray_up()
        assert ready.waits == [False, True]
        assert gc.isenabled(), "the collector runs again once Ray is up"
        assert not ready.released
        startup.ray_done()
        assert ready.released, "Ray is let go once the workers are gone, before the run's last logging"
    assert list(startup.clock.phases) == ["check", "tracking", "ray"]


def test_a_step_called_before_the_inputs_are_valid_is_a_programming_error():
    typed, _, _ = to_typed(compose_config())
    with Startup(typed) as startup:
        with pytest.raises(RuntimeError, match="before Startup.inputs_valid"):
            startup.tracking_module()
        with pytest.raises(RuntimeError, match="before Startup.inputs_valid"):
            startup.checked()
    assert gc.isenabled(), "leaving the block runs the collector again"
