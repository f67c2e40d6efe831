"""The start-up clock: each phase measured from the end of the one before, once."""

from __future__ import annotations

import time

import pytest

from orchestrator.startup import PHASES, StartupClock, describe


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
    with pytest.raises(ValueError, match="unknown start-up phase 'launch'; known: check, tracking, ray"):
        StartupClock().mark("launch")


def test_describe_lists_the_phases_in_the_order_they_ran():
    assert describe({"check": 2.14, "first_report": 1.0}) == "check 2.1s, first report 1.0s"
    assert list(PHASES)[-1] == "first_report"
