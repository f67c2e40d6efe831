"""Naming a slow rank and the phase it loses time in, from the phases every rank times (pure: the
reports are built here; a real slow rank in real training is in tests/test_train_e2e.py)."""

from __future__ import annotations

import pytest

from orch.launchers.job import StepReport
from orch.tracking.stragglers import StragglerWatch, rank_phase_metrics, slow_phase


def report(rank: int, step: int, **phases: float) -> StepReport:
    return StepReport(rank=rank, step=step, loss=1.0, local_loss=1.0, lr=1e-3, step_time_s=sum(phases.values()),
                      samples_per_s=1.0, tokens_per_s=None, epoch=0, first_batch_digest="", phase_time_s=phases)


def slow_forward(step: int, extra: float = 0.05) -> list[StepReport]:
    """Rank 1 computes its forward ``extra`` s slower; the others wait for it in the backward's
    gradient reduction, so every step takes as long."""
    return [report(0, step, forward=0.10, backward=0.20 + extra, optimizer=0.02),
            report(1, step, forward=0.10 + extra, backward=0.20, optimizer=0.02),
            report(2, step, forward=0.10, backward=0.20 + extra, optimizer=0.02)]


def test_the_first_phase_where_a_rank_exceeds_the_median_names_it_not_the_ranks_that_wait_for_it():
    found = slow_phase(slow_forward(10), threshold=0.1)
    assert (found.rank, found.phase) == (1, "forward")
    assert found.excess_s == pytest.approx(0.05) and found.share == pytest.approx(0.05 / 0.37)
    # Within the threshold: noise, nobody named.
    assert slow_phase(slow_forward(10, extra=0.01), threshold=0.1) is None
    assert slow_phase(slow_forward(10)[:1], threshold=0.1) is None  # one rank has no peers


def test_a_rank_is_named_after_several_reports_in_a_row_once_and_again_after_it_recovered():
    watch = StragglerWatch(threshold=0.1, reports=3, hostnames={1: "node-b"})
    assert watch.observe(slow_forward(5)) is None
    assert watch.observe(slow_forward(10)) is None
    named = watch.observe(slow_forward(15))
    assert (named.rank, named.phase, named.first_step, named.last_step) == (1, "forward", 5, 15)
    assert named.message().startswith("rank 1 on node-b is a straggler: forward +50.0 ms/step (+14% of")
    assert watch.observe(slow_forward(20)) is None  # named already
    even = [report(r, 25, forward=0.1, backward=0.2, optimizer=0.02) for r in range(3)]
    assert watch.observe(even) is None
    for step in (30, 35):
        assert watch.observe(slow_forward(step)) is None
    assert watch.observe(slow_forward(40)).first_step == 30
    # A report that timed no phase (a step not sampled) leaves the streak as it was.
    quiet = StragglerWatch(threshold=0.1, reports=2)
    assert quiet.observe(slow_forward(5)) is None
    assert quiet.observe([report(r, 6) for r in range(3)]) is None
    assert quiet.observe(slow_forward(7)).rank == 1
    assert StragglerWatch(threshold=0.0, reports=1).observe(slow_forward(5)) is None  # 0 turns it off


def test_every_ranks_phases_are_tracked_only_where_they_differ():
    metrics = rank_phase_metrics(slow_forward(10), threshold=0.1)
    assert metrics["step_phase/rank1/forward_s"] == pytest.approx(0.15)
    assert metrics["step_phase/rank0/backward_s"] == pytest.approx(0.25) and len(metrics) == 9
    even = [report(r, 10, forward=0.1, backward=0.2) for r in range(2)]
    assert rank_phase_metrics(even, threshold=0.1) == {}


def test_ranks_are_compared_with_the_ranks_of_their_own_pipeline_stage():
    """Two stages of two ranks: the last stage runs the head and the loss, longer by design, and is
    no straggler; a rank slower than its own stage's other rank is."""
    stages = {0: 0, 1: 0, 2: 1, 3: 1}
    even = [report(0, 5, forward=0.1, backward=0.2), report(1, 5, forward=0.1, backward=0.2),
            report(2, 5, forward=0.2, backward=0.1), report(3, 5, forward=0.2, backward=0.1)]
    assert slow_phase(even, threshold=0.1) is not None  # against every rank: the last stage looks slow
    assert slow_phase(even, threshold=0.1, stages=stages) is None
    assert rank_phase_metrics(even, threshold=0.1, stages=stages) == {}
    slow = even[:3] + [report(3, 5, forward=0.3, backward=0.1)]
    found = slow_phase(slow, threshold=0.1, stages=stages)
    assert (found.rank, found.phase) == (3, "forward") and found.excess_s == pytest.approx(0.05)


PARTS = {"compute": 0.20, "memory": 0.05, "dp": 0.03, "optimizer": 0.02, "offload": 0.0}
"""A predicted step of 0.30 s: 0.28 s in forward and backward, 0.02 s in the optimizer step."""


def uniform(step: int, forward: float, optimizer: float = 0.02) -> list[StepReport]:
    """Two ranks equally fast (or slow): no peer stands out."""
    return [report(rank, step, forward=forward, backward=0.18, optimizer=optimizer) for rank in (0, 1)]


def test_every_rank_slower_than_the_plan_allows_is_named_with_the_phase_and_the_slowest_rank():
    from orch.tracking.plan_slowdown import PlanWatch

    # The prediction's P90 is 1.2x; the threshold adds 0.1 of the predicted step: 0.28 * 1.2 + 0.03 = 0.366 s.
    watch = PlanWatch(PARTS, p90_ratio=1.2, threshold=0.1, reports=3, hostnames={0: "node-a", 1: "node-b"})
    assert watch.allowed_s(0.28) == pytest.approx(0.366)
    # Within what the prediction's error allows: forward and backward take 0.36 s. Nothing, ever.
    assert [watch.observe(uniform(step, forward=0.18)) for step in (5, 10, 15, 20)] == [None] * 4
    # Both ranks slow alike (0.30 + 0.18 = 0.48 s): the peers' comparison names nobody, the plan's does,
    # at the third report in a row, with the rank that was slowest and its host.
    slow = [uniform(step, forward=0.30) for step in (25, 30, 35, 40)]
    slow[2][1] = report(1, 35, forward=0.31, backward=0.18, optimizer=0.02)
    assert all(slow_phase(reports, threshold=0.1) is None for reports in slow)
    found = [watch.observe(reports) for reports in slow]
    assert found[:2] == [None, None] and found[3] is None  # named once, not again while it lasts
    named = found[2]
    assert (named.phase, named.rank, named.hostname) == ("forward and backward", 1, "node-b")
    assert (named.first_step, named.last_step) == (25, 35)
    assert named.predicted_s == pytest.approx(0.28) and named.measured_s == pytest.approx((0.48 * 2 + 0.49) / 3)
    assert named.message() == ("the step is slower than the plan predicts: forward and backward 483.3 ms/step "
                               "against 280.0 ms predicted (1.7x; its error allows up to 366.0 ms), steps 25-35; "
                               "slowest: rank 1 on node-b")
    # Back within the prediction, then slow again: named again.
    watch.observe(uniform(45, forward=0.18))
    assert [watch.observe(uniform(step, forward=0.30)) for step in (50, 55, 60)][2] is not None


def test_a_slow_optimizer_step_is_named_in_its_own_phase_and_untimed_reports_change_nothing():
    from orch.tracking.plan_slowdown import PlanWatch

    watch = PlanWatch(PARTS, p90_ratio=1.2, threshold=0.1, reports=2)
    untimed = [StepReport(rank=0, step=7, loss=1.0, local_loss=1.0, lr=1e-3, step_time_s=1.0, samples_per_s=1.0,
                          tokens_per_s=None, epoch=0, first_batch_digest="")]
    assert watch.observe(uniform(5, forward=0.1, optimizer=0.2)) is None
    assert watch.observe(untimed) is None
    named = watch.observe(uniform(10, forward=0.1, optimizer=0.2))
    assert (named.phase, named.first_step, named.last_step) == ("optimizer step", 5, 10)
    # Switched off by a zero threshold, as the peers' comparison is.
    off = PlanWatch(PARTS, p90_ratio=1.2, threshold=0.0, reports=1)
    assert off.observe(uniform(5, forward=2.0)) is None
