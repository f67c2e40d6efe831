"""`orch export RUN_ID` builds the model from the command's own config, never from what the run's
tracked artifacts declare: a real run (2 DeepSpeed workers in Ray actors, a checkpoint, a local
MLflow store) is exported through the installed `orch` command after its artifacts, and then its
checkpoint's manifest, were edited the way someone with write access to them would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers.orch_command import orch_run

pytestmark = pytest.mark.slow

ORCH = shutil.which("orch", path=os.path.dirname(sys.executable)) or "orch"
TAG = "step_000000004"


def orch(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return orch_run([*args], cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """The user's directory after a short `orch train` with a checkpoint, and the run's id."""
    where = tmp_path_factory.mktemp("exported")
    done = orch(where, "train", "train.steps=4", "train.log_every=2", "train.eval_batches=1",
                "plan.micro_batch_size=4", "train.checkpoint_every=4", "train.checkpoint_dir=ckpt")
    assert done.returncode == 0, done.stderr[-3000:]
    return where, re.search(r"MLflow run ([0-9a-f]{32})", done.stdout).group(1)


def chain(marker: Path) -> dict:
    """Nested targets that write ``marker`` when instantiated: Hydra's blocklist lets each through."""
    return {"_target_": "builtins.len", "_args_": [{"_target_": "pathlib.Path.write_text", "data": "ran",
                                                    "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]}}]}


def artifact(where: Path, run_id: str, path: str) -> Path:
    [found] = where.glob(f"mlruns/*/{run_id}/artifacts/{path}")
    return found


def test_code_planted_in_the_runs_config_artifact_never_runs_and_the_export_uses_the_users_config(trained):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file, load_model

    from orch.workloads.gpt import GPT

    where, run_id = trained
    resolved = artifact(where, run_id, "config/resolved.yaml")
    original = resolved.read_text()
    planted = yaml.safe_load(original)
    planted["model"]["n_layer"] = chain(where / "ran-from-model")
    planted["data"] = {"_target_": "os.makedirs", "name": str(where / "ran-from-data")}
    planted["objective"] = {"_target_": "os.makedirs", "name": str(where / "ran-from-objective")}
    resolved.write_text(yaml.safe_dump(planted))
    try:
        done = orch(where, "export", run_id, "--out", "out")
    finally:
        resolved.write_text(original)
    assert not list(where.glob("ran-from-*")), "code from the run's artifacts ran"
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported {TAG} of run {run_id}" in done.stdout
    # The weights written are the trained ones: the model gives the engine's output at the end of the run.
    check = load_file(MlflowClient(tracking_uri=f"sqlite:///{where / 'mlflow.db'}")
                      .download_artifacts(run_id, "model/check.safetensors", str(where)))
    model = GPT()
    load_model(model, str(where / "out" / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(check["batch.0"]), check["output"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("section,field", [("n_layer", "model.n_layer"), ("_target_", "model._target_")])
def test_a_checkpoint_manifest_declaring_another_model_is_refused_before_anything_is_built(trained, section,
                                                                                          field):
    """Someone who can write the checkpoint directory too can rewrite its manifest (it is not signed):
    what it declares is compared with the command's config, never instantiated."""
    where, run_id = trained
    marker = where / "ran-from-manifest"
    manifest = where / "ckpt" / TAG / "manifest.json"
    original = manifest.read_text()
    planted = json.loads(original)
    planted["model"]["config"][section] = chain(marker) if section == "n_layer" else "pathlib.Path.write_text"
    manifest.write_text(json.dumps(planted))
    try:
        done = orch(where, "export", run_id, "--out", "refused")
    finally:
        manifest.write_text(original)
    assert not marker.exists() and not (where / "refused").exists()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{field}=" in done.stderr and f"the checkpoint ckpt/{TAG} was written by a model with {field}=" \
        in done.stderr
    assert "Fix: export with the same --config-dir, model option and model.* overrides as the run's `orch train`" \
        in done.stderr


def test_an_export_whose_config_declares_another_model_is_refused_naming_the_field_and_its_value(trained):
    where, run_id = trained
    done = orch(where, "export", run_id, "--out", "refused", "model.n_layer=3")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"model.n_layer=3: the checkpoint ckpt/{TAG} was written by a model with model.n_layer=2; the model is "
            "built from this command's config, which must declare the model the run was trained with. "
            "Fix: set model.n_layer=2") in done.stderr
    assert not (where / "refused").exists()
