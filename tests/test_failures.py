"""What failures cost a run and the checkpoint interval that minimizes it (Young/Daly): the maths
(pure), and `orch tune`'s expected time to train and recommended train.checkpoint_every."""

from __future__ import annotations

import math

import pytest

from helpers.config import compose_config
from orch.config import to_typed
from orch.plans.errors import PlanError
from orch.plans.spec import ClusterSpec, OptimizerName, OptimSpec, Precision
from orch.plans.step_time.failures import FailureModel, checkpoint_bytes, failure_model


def test_a_checkpoint_holds_the_weights_the_master_copy_and_the_moments():
    adam = OptimSpec(name=OptimizerName.adamw)
    assert checkpoint_bytes(10, Precision.bf16, adam) == 10 * (2 + 4 + 8)
    assert checkpoint_bytes(10, Precision.fp32, adam) == 10 * (4 + 8)
    assert checkpoint_bytes(10, Precision.fp32, OptimSpec(name=OptimizerName.sgd)) == 40
    assert checkpoint_bytes(10, Precision.fp32, OptimSpec(name=OptimizerName.sgd, momentum=0.9)) == 80


def test_the_interval_is_young_dalys_and_minimizes_the_expected_time():
    model = FailureModel(job_mtbf_s=36000.0, save_s=50.0, restart_s=300.0, checkpoint_gb=100.0)
    assert model.interval_s == pytest.approx(math.sqrt(2 * 50 * 36000) - 50)
    best = model.factor()
    assert best == pytest.approx((1 + 50 / model.interval_s) * (1 + (300 + (model.interval_s + 50) / 2) / 36000))
    for other in (0.5 * model.interval_s, 0.8 * model.interval_s, 1.25 * model.interval_s, 2 * model.interval_s):
        assert model.factor(other) > best
    assert model.checkpoint_every(step_s=2.0) == round(model.interval_s / 2.0)
    assert model.checkpoint_every(step_s=1e6) == 1
    # Saves as long as half the time between failures: one checkpoint per failure interval.
    slow = FailureModel(job_mtbf_s=100.0, save_s=60.0, restart_s=0.0, checkpoint_gb=1.0)
    assert slow.interval_s == 100.0


def test_the_cluster_declares_its_failures_per_node():
    adam = OptimSpec(name=OptimizerName.adamw)
    assert failure_model(ClusterSpec(), 10**9, Precision.bf16, adam) is None
    model = failure_model(ClusterSpec(nodes=4, mtbf_hours=1000.0, storage_gb_per_s=2.0, restart_s=120.0),
                          10**9, Precision.bf16, adam)
    assert model.job_mtbf_s == pytest.approx(1000 * 3600 / 4)  # any node's failure stops the job
    assert model.save_s == pytest.approx(14.0 / (2.0 * 4)) and model.checkpoint_gb == pytest.approx(14.0)
    assert model.restart_s == 120.0 and "checkpoint every" in model.describe()
    from orch.declared import declared_violations

    [bad] = declared_violations(to_typed(compose_config("cluster.mtbf_hours=0"))[0])
    assert bad.field == "cluster.mtbf_hours" and "above 0" in str(PlanError([bad]))


def test_tune_predicts_the_time_to_train_with_failures_and_the_checkpoint_interval(tmp_path):
    from orch.tune.result import render
    from orch.tune.search import tune

    typed, model_cfg, _ = to_typed(compose_config(f"tune.out={tmp_path / 'w.yaml'}", "train.global_batch_size=16",
                                                  "tune.pp=[1]", "cluster.mtbf_hours=0.5", "cluster.restart_s=60"))
    result = tune(typed, model_cfg)
    budget = result.budget
    doc = result.as_json(top_k=3)
    assert doc["budget"]["failures"]["job_mtbf_s"] == pytest.approx(1800.0)
    best = doc["best"]["predicted"]
    step_s = best["step_time_s"]
    assert best["expected_time_to_train_s"] == pytest.approx(best["time_to_train_s"] * budget.failures.factor())
    assert best["expected_time_to_train_s"] > best["time_to_train_s"]
    assert best["checkpoint_every"] == budget.failures.checkpoint_every(step_s)
    table = render(result, top_k=3)
    assert "failures: a failure every 0.5 h" in table
    assert f"(train.checkpoint_every={best['checkpoint_every']})" in table
