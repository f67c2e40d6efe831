"""Workloads other than the built-in GPT, trained for real: the shipped experiments (a torchvision
ViT with ZeRO-3 and bf16, ResNet-50 in bf16, a Llama-shaped Hugging Face LM on tokenized text),
and a Hugging Face model sharded through its own tensor-parallel plan."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import compose_config
from orchestrator.config import to_typed
from orchestrator.driver import run_training

pytestmark = pytest.mark.slow


def train(sqlite_uri: str, *overrides: str):
    return run_training(*to_typed(compose_config(f"tracking.uri={sqlite_uri}", *overrides)))


@pytest.mark.parametrize("experiment,steps", [("vit_zero3_bf16", 40), ("resnet50_bf16", 30), ("llama_text", 40)])
def test_each_shipped_experiment_trains_and_logs_predicted_and_measured_memory(local_ray, sqlite_uri, tmp_path,
                                                                             experiment, steps):
    result = train(sqlite_uri, f"experiment={experiment}", f"train.steps={steps}", "train.log_every=10",
                   "data.cache_dir=" + str(tmp_path / "cache") if experiment == "llama_text" else "train.seed=1234")
    losses = [reports[0]["loss"] for reports in result.reports]
    assert losses[-1] < losses[0], losses
    metrics = MlflowClient(tracking_uri=sqlite_uri).get_run(result.run_id).data.metrics
    assert metrics["memory/predicted_peak_bytes"] > 0 and metrics["memory/measured_peak_bytes"] > 0
    assert "eval_loss" in metrics
    if experiment == "llama_text":
        assert metrics["tokens_per_s"] > 0
    else:  # classification: no tokens, an accuracy
        assert "tokens_per_s" not in metrics and 0 <= metrics["eval_accuracy"] <= 1
        assert metrics["samples_per_s"] > 0


def test_a_hugging_face_model_is_sharded_by_its_own_tensor_parallel_plan(local_ray, sqlite_uri):
    result = train(sqlite_uri, "model=hf_causal_lm", "plan.tp=2", "train.steps=20", "train.log_every=10")
    losses = [reports[0]["loss"] for reports in result.reports]
    assert losses[-1] < losses[0] - 0.5, losses
    # Each rank holds the replicated embeddings and norms and half of every projection.
    assert all(f["params_on_rank"] < result.model.param_count for f in result.worker_facts)
    assert [f["tp_rank"] for f in result.worker_facts] == [0, 1]
