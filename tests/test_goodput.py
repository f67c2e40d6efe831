"""Where a run's wall time goes (orch/tracking/goodput.py), on reports built here with a clock the
test sets; a real run that fails twice, replays steps, checkpoints and evaluates is accounted in
tests/test_reliability.py."""

from __future__ import annotations

import pytest

from orch.launchers.job import StepReport
from orch.tracking.goodput import GoodputLedger


def reports(step: int, *, steps: int, step_time_s: float, checkpoint_s: float = 0.0, eval_s: float = 0.0):
    return [StepReport(rank=rank, step=step, loss=1.0, local_loss=1.0, lr=1e-3,
                       step_time_s=step_time_s * (1 + rank / 10), samples_per_s=1.0, tokens_per_s=None, epoch=0,
                       first_batch_digest="", steps=steps, checkpoint_s=checkpoint_s * (1 + rank),
                       eval_s=eval_s) for rank in range(2)]


def test_a_run_with_a_restart_is_accounted_attempt_by_attempt_and_adds_up_to_its_wall_time():
    ledger = GoodputLedger(started=100.0)
    ledger.attempt_started(now=100.0)
    # Start-up until the first report's steps began: 10 s, then 5 steps of 1.1 s (the slower rank).
    ledger.reported(reports(5, steps=5, step_time_s=1.0), redone=False, now=115.5)
    ledger.reported(reports(10, steps=5, step_time_s=1.0, checkpoint_s=1.0), redone=False, now=123.0)
    ledger.attempt_failed("ActorDiedError", now=126.0)
    ledger.attempt_started(now=130.0)
    ledger.reported(reports(10, steps=5, step_time_s=1.0), redone=True, now=145.5)
    ledger.reported(reports(15, steps=5, step_time_s=1.0, eval_s=2.0), redone=False, now=153.0)
    total = ledger.totals(now=154.0)
    assert total["training"] == pytest.approx(5.5 * 3) and total["redone"] == pytest.approx(5.5)
    assert total["checkpoint"] == pytest.approx(2.0) and total["evaluation"] == pytest.approx(2.0)
    # Attempt 1 lost the 3 s after its last report and waited 4 s for the next group.
    assert total["restart"] == pytest.approx(7.0)
    assert total["startup"] == pytest.approx(10.0 + 10.0)
    assert total["wall"] == pytest.approx(54.0) and total["goodput"] == pytest.approx(16.5 / 54.0)
    kinds = ("training", "startup", "checkpoint", "evaluation", "restart", "redone", "other")
    assert sum(total[k] for k in kinds) == pytest.approx(54.0)
    assert total["other"] == pytest.approx(54.0 - 16.5 - 5.5 - 2 - 2 - 7 - 20)
    doc = ledger.as_dict(now=154.0)
    assert [a["failed"] for a in doc["attempts"]] == ["ActorDiedError", None]
    assert doc["attempts"][0]["seconds"]["restart"] == pytest.approx(7.0)
    metrics = ledger.metrics(now=154.0)
    assert metrics["goodput"] == pytest.approx(16.5 / 54.0) and metrics["goodput/redone_s"] == pytest.approx(5.5)
    assert ledger.summary(now=154.0).startswith("goodput 31% of 54.0 s wall: training 16.5 s, startup 20.0 s")
