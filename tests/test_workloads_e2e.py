"""Workloads other than the built-in GPT, trained for real: the shipped experiments (a torchvision
ViT with ZeRO-3 and bf16, ResNet-50 with recomputation, a Llama-shaped Hugging Face LM on tokenized text),
and a Hugging Face model sharded through its own tensor-parallel plan."""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from helpers.config import compose_config
from orch.config import to_typed
from orch.plans.model.workload import output_tensor
from orch.run.driver import run_training
from orch.workload import build_data_source

pytestmark = pytest.mark.slow


def train(sqlite_uri: str, *overrides: str):
    return run_training(*to_typed(compose_config(f"tracking.uri={sqlite_uri}", *overrides)))


# ResNet-50 also recomputes its bottleneck blocks: torchvision models have no checkpointing switch
# of their own, so this is orch.plans.model.workload.enable_activation_checkpointing wrapping them.
# Both torchvision models train in their shipped bf16: on a CPU without bf16 instructions the
# workers compute the convolutions and matmuls in fp32 (orch/launchers/cpu_bf16.py).
@pytest.mark.parametrize("experiment,steps,extra", [("vit_zero3_bf16", 20, []),
                                                    ("resnet50_bf16", 30, ["plan.activation_checkpointing=true"]),
                                                    ("llama_text", 40, [])])
def test_each_shipped_experiment_trains_and_logs_predicted_and_measured_memory(local_ray, sqlite_uri, tmp_path,
                                                                             experiment, steps, extra):
    result = train(sqlite_uri, f"experiment={experiment}", f"train.steps={steps}", "train.log_every=10",
                   "data.cache_dir=" + str(tmp_path / "cache") if experiment == "llama_text" else "train.seed=1234",
                   *extra)
    losses = [reports[0].loss for reports in result.reports]
    assert losses[-1] < losses[0], losses
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(result.run_id)
    metrics = run.data.metrics
    # Lineage: the data is the run's dataset input, named by the digest of its content.
    [data_input] = run.inputs.dataset_inputs
    assert data_input.tags[0].value == "train" and len(data_input.dataset.digest) == 16
    typed, _, _ = to_typed(compose_config(f"experiment={experiment}"))
    described = build_data_source(typed.data).describe()
    assert data_input.dataset.digest == described["digest"][:16]
    assert json.loads(data_input.dataset.profile)["size"] == described["size"] > 0
    assert metrics["memory/predicted_peak_bytes"] > 0 and metrics["memory/measured_peak_bytes"] > 0
    assert "eval_loss" in metrics
    if experiment == "llama_text":
        assert metrics["tokens_per_s"] > 0
    else:  # classification: no tokens, an accuracy
        assert "tokens_per_s" not in metrics and 0 <= metrics["eval_accuracy"] <= 1
        assert metrics["samples_per_s"] > 0
    # The trained model comes out: reloaded by MLflow's own loader, it gives the engine's outputs.
    model, check = exported_model(sqlite_uri, result.run_id)
    weights = {a.path for a in MlflowClient(tracking_uri=sqlite_uri).list_artifacts(result.run_id, "model/weights")}
    # The requirements to load it back name the library its classes come from, pinned.
    requirements = Path(MlflowClient(tracking_uri=sqlite_uri).download_artifacts(
        result.run_id, "model/mlflow_model/requirements.txt", str(tmp_path))).read_text().split()
    provider = "transformers" if experiment == "llama_text" else "torchvision"
    assert f"{provider}=={importlib.metadata.version(provider)}" in requirements, requirements
    assert f"torch=={importlib.metadata.version('torch')}" in requirements, requirements
    if experiment == "llama_text":
        assert {"model/weights/config.json", "model/weights/model.safetensors"} <= weights  # save_pretrained
    else:
        assert weights == {"model/weights/model.safetensors"}
    # The engine computed in its training precision: the exported fp32 model is run in the same one.
    dtype = result.plan.precision.dtype
    with torch.no_grad():
        output = output_tensor(model.to(dtype)(check["batch.0"].to(dtype) if check["batch.0"].is_floating_point()
                                               else check["batch.0"])).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output, check["output"], atol=tolerance, rtol=tolerance)


def exported_model(uri: str, run_id: str):
    import mlflow
    import mlflow.pytorch
    from safetensors.torch import load_file

    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(f"runs:/{run_id}/model/mlflow_model").eval()
    check = load_file(MlflowClient(tracking_uri=uri).download_artifacts(run_id, "model/check.safetensors"))
    return model, check


def test_a_hugging_face_model_is_sharded_by_its_own_tensor_parallel_plan(local_ray, sqlite_uri):
    result = train(sqlite_uri, "model=hf_causal_lm", "plan.tp=2", "train.steps=20", "train.log_every=10")
    losses = [reports[0].loss for reports in result.reports]
    assert losses[-1] < losses[0] - 0.5, losses
    # Each rank holds the replicated embeddings and norms and half of every projection.
    assert all(f.model.params_on_rank < result.model.param_count for f in result.worker_facts)
    assert [f.tp_rank for f in result.worker_facts] == [0, 1]
    # The shards are gathered into the whole model, which gives the sharded engine's outputs.
    model, check = exported_model(sqlite_uri, result.run_id)
    with torch.no_grad():
        output = output_tensor(model(check["batch.0"]))
    torch.testing.assert_close(output, check["output"], atol=1e-4, rtol=1e-4)


def test_a_hugging_face_model_under_zero3_keeps_its_own_initialization_and_its_pretrained_weights(
        local_ray, sqlite_uri, tmp_path):
    """Under ZeRO-3 the model is built inside zero.Init, which empties each parameter into its
    partition as soon as it exists; transformers, told of it, initializes and loads the weights
    into the partitions. Untold, a model built from its config kept torch's default init (first
    loss ~114 on 256 tokens), and one loaded from a directory lost its pretrained weights."""
    first_loss = lambda *overrides: train(sqlite_uri, "model=hf_causal_lm", "train.steps=2",  # noqa: E731
                                          "train.log_every=1", *overrides).reports[0][0].loss
    built = first_loss("plan.zero_stage=3")
    assert abs(built - math.log(256)) < 0.5, built  # the model's own init (std 0.02): near-uniform predictions
    from orch.workloads.hf import hf_causal_lm

    typed, model_cfg, _ = to_typed(compose_config("model=hf_causal_lm"))
    model = hf_causal_lm(config=model_cfg["config"])
    with torch.no_grad():  # weights no initialization gives: the loss tells whether they were loaded
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(tmp_path / "pretrained")
    loaded = [first_loss("model.config=null", f"model.pretrained_path={tmp_path / 'pretrained'}",
                         f"plan.zero_stage={stage}") for stage in (2, 3)]
    assert loaded[1] == pytest.approx(loaded[0], rel=1e-4), loaded
    assert abs(loaded[1] - built) > 0.5, (loaded, built)


def test_orch_export_consolidates_a_sharded_checkpoint_into_the_trained_model(local_ray, sqlite_uri, tmp_path):
    from safetensors.torch import load_model

    from orch.export import export_run
    from orch.workloads.gpt import GPT

    result = train(sqlite_uri, "plan.zero_stage=2", "train.steps=10", "train.log_every=5",
                   "train.checkpoint_every=10", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    _, check = exported_model(sqlite_uri, result.run_id)  # the engine's output at the end of the run
    assert export_run(sqlite_uri, result.run_id, to_typed(compose_config())[1], tmp_path / "out") == "step_000000010"
    model = GPT()
    load_model(model, str(tmp_path / "out" / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(check["batch.0"]), check["output"], atol=1e-5, rtol=1e-5)
    reloaded, _ = exported_model(sqlite_uri, result.run_id)  # the export replaced the logged model
    with torch.no_grad():
        torch.testing.assert_close(reloaded(check["batch.0"]), check["output"], atol=1e-5, rtol=1e-5)
