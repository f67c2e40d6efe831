"""Timing a step by phase (the clock every rank runs) and setting the phases beside the predicted
parts (what `orch report` prints): pure logic; the end-to-end runs are in test_cli.py (data
parallel) and test_cluster.py (a pipeline)."""

from __future__ import annotations

import types

import pytest

from orch.launchers import step_phases
from orch.launchers.step_phases import PhaseClock
from orch.tracking.step_prediction import compare_phases, most_wrong


class FakeTime:
    """The clock's ``time.perf_counter``, moved on by hand: a phase lasts exactly what the test
    says, however loaded the machine (a real sleep can overrun by tens of milliseconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(step_phases, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_the_clock_times_sampled_steps_by_phase_and_skips_the_rest(fake_time):
    synced = []
    clock = PhaseClock(every=2, synchronize=lambda: synced.append(1))
    for step in (1, 2, 3, 4):
        clock.begin(step, skip=step == 4)  # step 4 is the memory-probe step: not timed
        fake_time.sleep(0.01)
        clock.milestone("forward")
        fake_time.sleep(0.02)
        clock.milestone("backward")
        clock.milestone("optimizer")
        clock.milestone()  # a milestone without a phase, as an engine of older code calls it
        clock.end()
    means = clock.take()
    assert set(means) == {"forward", "backward", "optimizer", "other"}
    assert means["forward"] == pytest.approx(0.01) and means["backward"] == pytest.approx(0.02)
    assert len(synced) == 6  # only step 2: its start and five phase ends, each after the device's work
    assert clock.take() == {}  # nothing sampled since


def test_waiting_for_a_batch_is_taken_out_of_the_phase_it_fell_in(fake_time):
    clock = PhaseClock(every=1)
    clock.begin(1)
    fake_time.sleep(0.01)
    clock.data_wait(0.03)  # more than the phase lasted: at most the phase's own time is data wait
    clock.milestone("forward")
    clock.begin(2)
    fake_time.sleep(0.03)
    clock.data_wait(0.02)  # the engine drew its batch inside the forward phase
    clock.milestone("forward")
    clock.end()
    means = clock.take()
    assert means["data_wait"] == pytest.approx((0.01 + 0.02) / 1)
    assert means["forward"] == pytest.approx(0.01)  # 0 in step 1, 0.01 in step 2, one sample counted
    clock.begin(3)
    clock.data_wait(5.0)
    clock.end()  # not sampled data wait does not leak into a later step
    clock.begin(4)
    clock.milestone("forward")
    clock.end()
    assert clock.take().get("data_wait", 0.0) == 0.0


def test_phases_are_compared_as_the_engines_can_split_them():
    parts = {"compute": 2.0, "memory": 1.0, "dp": 0.5, "tp": 0.0, "optimizer": 0.25, "offload": 0.25}
    forward_backward, optimizer, other = compare_phases(parts, {"forward": 1.0, "backward": 2.0, "optimizer": 1.5,
                                                                "other": 0.1})
    assert (forward_backward.predicted_s, forward_backward.measured_s) == (3.5, 3.0)
    assert (optimizer.predicted_s, optimizer.measured_s) == (0.5, 1.5)
    assert (other.predicted_s, other.measured_s) == (0.0, 0.1)
    assert most_wrong([forward_backward, optimizer, other]) is optimizer
    # A pipeline schedule is one call: the whole step against it.
    pipelined, outside = compare_phases({**parts, "bubble": 1.0}, {"pipeline": 6.0, "other": 0.0})
    assert pipelined.name == "pipeline schedule" and (pipelined.predicted_s, pipelined.measured_s) == (5.0, 6.0)
