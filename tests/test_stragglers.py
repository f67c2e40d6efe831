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
