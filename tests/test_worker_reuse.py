"""Workers kept between the runs of one driver (orch.launchers.worker_pool): consecutive runs of
the same shape train in the same processes and as they would in new ones; a run of another shape
gets new processes; and nothing stays reserved once the block ends."""

from __future__ import annotations

import os
import time

import pytest
import ray

from helpers.config import compose_config
from orch.config import to_typed
from orch.launchers.process_baseline import ProcessBaseline
from orch.launchers.worker_pool import reusing_workers
from orch.run.driver import run_training

SHORT = ["train.steps=8", "train.log_every=4", "train.eval_batches=1", "plan.micro_batch_size=4", "plan.dp=2",
         "train.export=false"]


def train(uri: str, name: str, *overrides: str):
    cfg = compose_config(*SHORT, f"tracking.uri={uri}", f"tracking.run_name={name}", *overrides)
    return run_training(*to_typed(cfg))


def pids(result) -> list[int]:
    return [fact.pid for fact in result.worker_facts]


def losses(result) -> list[float]:
    return [reports[0].loss for reports in result.reports]


@pytest.mark.slow
def test_consecutive_runs_reuse_their_workers_and_train_as_new_ones_would(local_ray, sqlite_uri):
    with reusing_workers():
        first = train(sqlite_uri, "zero1", "plan.zero_stage=1")
        # Another engine in the same processes: DeepSpeed's process-group caches were emptied.
        fsdp2 = train(sqlite_uri, "fsdp2", "plan.engine=fsdp2")
        again = train(sqlite_uri, "zero1-again", "plan.zero_stage=1")
        # Another worker environment (hang detection off: no collectives' timeout): other processes,
        # placed once the idle ones let go of both CPUs of this 2-CPU Ray.
        other = train(sqlite_uri, "other-env", "plan.zero_stage=1", "train.hang_timeout_s=0")
    assert pids(first) == pids(fsdp2) == pids(again)
    assert not set(pids(other)) & set(pids(first))
    # The same plan, seed and data train to the same losses in a reused process as in a new one.
    assert losses(again) == pytest.approx(losses(first), rel=1e-6)
    assert losses(other) == pytest.approx(losses(first), rel=1e-6)
    assert losses(fsdp2)[-1] < losses(fsdp2)[0]
    # The block's end releases the idle workers: every placement group removed, every CPU free.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "idle workers still hold resources"
        time.sleep(0.5)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_reset_process_forgets_the_runs_environment_path_and_user_modules(tmp_path, monkeypatch):
    """What a reused worker goes back to before its next run: the environment, the import path and
    the modules of its first moment; the user's modules imported since are imported afresh (their
    module-level state gone), installed ones stay."""
    import sys

    monkeypatch.setenv("ORCH_TEST_KEPT", "before")
    (tmp_path / "users_model.py").write_text("CALLS = []\n")
    baseline = ProcessBaseline.now()
    monkeypatch.setenv("ORCH_TEST_KEPT", "changed by a run")
    monkeypatch.setenv("ORCH_TEST_ADDED", "by a run")
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_model

    users_model.CALLS.append("state of the first run")
    import json.tool  # noqa: F401 - installed: stays imported

    forgotten = baseline.restore()
    assert forgotten == ["users_model"]
    assert "users_model" not in sys.modules and "json.tool" in sys.modules
    assert os.environ["ORCH_TEST_KEPT"] == "before" and "ORCH_TEST_ADDED" not in os.environ
    assert str(tmp_path) not in sys.path
    sys.path.insert(0, str(tmp_path))
    try:
        import users_model as again
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("users_model", None)
    assert again.CALLS == []
