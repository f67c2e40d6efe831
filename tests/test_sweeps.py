"""Sweeps through the real `orch` CLI: `--multirun` as one parent MLflow run with its jobs nested,
Hydra's Optuna sweeper minimizing what `orch train` returns, and the sweep metric checked first."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from helpers.orch_command import orch_run

SHORT = ["train.steps=4", "train.log_every=2", "train.eval_batches=1"]


def orch(*args: str, cwd) -> subprocess.CompletedProcess:
    return orch_run([*args], cwd=cwd, timeout=900)


def runs_of(tmp_path) -> tuple[MlflowClient, list]:
    """The runs of the store in ``tmp_path`` (none when no run was ever started there)."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("orch")
    return client, client.search_runs([experiment.experiment_id]) if experiment else []


@pytest.mark.slow
def test_an_optuna_sweep_is_one_parent_run_minimizing_the_eval_loss_and_survives_an_infeasible_trial(tmp_path):
    """Three trials of a seeded random sampler (micro-batches 4, 512, 2); 512 needs more than the
    declared 0.5 GiB device: refused, a failed trial, and the sweep goes on to pick the best.

    The sweep is one parent MLflow run with its jobs nested, compared on the parent. That part is
    Hydra callbacks (orch/sweeps.py), the same for every sweeper: Hydra's basic one runs
    the jobs of test_cli's failed sweep and of the sweep-metric check below."""
    done = orch("train", "--multirun", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random",
                "hydra.sweeper.sampler.seed=0",
                "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1", "hydra.sweeper.max_failure_rate=1.0",
                "plan.micro_batch_size=choice(2,4,8,512)", "cluster.device_memory_gib=0.5", "data.val_fraction=0.3",
                *SHORT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed: the plan has 1 problem(s):\n  - cluster.device_memory_gib" in done.stderr
    client, runs = runs_of(tmp_path)
    [parent] = [r for r in runs if r.data.tags.get("orch.command") == "sweep"]
    assert parent.data.tags["sweep.jobs"] == "3" and parent.data.tags["sweep.failed"] == "1"
    trained = [r for r in runs if r is not parent]
    assert sorted(int(r.data.params["plan.micro_batch_size"]) for r in trained) == [2, 4]
    [results] = list((tmp_path / "multirun").glob("*/*/optimization_results.yaml"))
    chosen = yaml.safe_load(results.read_text())
    best = min(trained, key=lambda r: r.data.metrics["eval_loss"])
    assert chosen["best_params"] == {"plan.micro_batch_size": int(best.data.params["plan.micro_batch_size"])}
    assert math.isclose(chosen["best_value"], best.data.metrics["eval_loss"], rel_tol=1e-6)
    # The parent: its jobs nested under it, compared one row per job, named by the override that
    # varies, and the best of them.
    assert parent.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in trained} == {parent.info.run_id}
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "sweep/jobs.json", str(tmp_path)))
                       .read_text())
    assert [(row["overrides"], row["status"]) for row in table["jobs"]] == [
        (["plan.micro_batch_size=4"], "COMPLETED"), (["plan.micro_batch_size=512"], "FAILED"),
        (["plan.micro_batch_size=2"], "COMPLETED")]
    assert parent.data.tags["sweep.best_run_id"] == best.info.run_id
    assert parent.data.metrics["best_eval_loss"] == best.data.metrics["eval_loss"]
    listed = orch("runs", cwd=tmp_path)
    lines = listed.stdout.splitlines()
    parent_line = next(i for i, line in enumerate(lines) if line.startswith(parent.info.run_id[:12]))
    assert all(lines[parent_line + k].startswith("  - ") for k in (1, 2)), listed.stdout
    report = orch("report", parent.info.run_id, "--out", "rep", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "jobs       3, 1 failed; metric eval_loss" in report.stdout, report.stdout
    assert "| plan.micro_batch_size=2 |" in report.stdout, report.stdout
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["jobs.md", "loss_curves.png"]


def test_the_sweep_metric_is_checked_before_any_job_of_a_sweep_trains(tmp_path):
    """A sweep on a metric no run logs fails before any job trains. (A plain run is not judged by
    train.sweep_metric: tests/test_cli.py::test_train_with_defaults_tracks_a_local_run.)"""
    swept = orch("train", "--multirun", "train.sweep_metric=foo", "optim.lr=0.001,0.003", *SHORT, cwd=tmp_path)
    assert swept.returncode == 2, swept.stderr[-3000:]
    assert "train.sweep_metric='foo': is no metric a run logs" in swept.stderr
    _, runs = runs_of(tmp_path)
    assert not [r for r in runs if r.data.tags.get("orch.command") != "sweep"]
    evaluating_nothing = orch("train", "--multirun", "optim.lr=0.001,0.003", *SHORT, "train.eval_batches=0",
                              cwd=tmp_path)
    assert evaluating_nothing.returncode == 2 and "train.eval_batches=0" in evaluating_nothing.stderr
