"""The trained model, out of the run: consolidated weights in the model's own format, logged to
the MLflow run as an MLflow model that ``mlflow.pytorch.load_model`` loads back.

A Hugging Face model is written with ``save_pretrained`` (safetensors); any other model as
``model.safetensors`` of its state dict. The engine's output on one held-out batch is logged
beside it (``model/check.safetensors``), so a reloaded model can be checked against it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from plans.workload import Workload


def build_trained(workload: Workload, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model built on CPU with the consolidated weights (in fp32, whatever the training precision)."""
    model = workload.model_factory()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied weight is listed once in a consolidated state (the embedding) and twice in the model.
    tied = {name for name in missing if name.endswith("lm_head.weight") or "tied" in name}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"the consolidated weights do not fit the model: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    return model.float().eval()


def save_weights(model: torch.nn.Module, out_dir: Path) -> Path:
    """``save_pretrained`` for a Hugging Face model, ``model.safetensors`` otherwise."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(out_dir, safe_serialization=True)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out_dir / "model.safetensors"))
    return out_dir


def log_trained_model(tracker, workload: Workload, exported: dict) -> None:
    """Save the weights, log them and an MLflow pytorch model, and the check batch, to the run."""
    from safetensors.torch import save_file

    from plans.workload import batch_targets

    model = build_trained(workload, exported["state"])
    _log_model(tracker, model)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = exported["batch"]
        tensors = {"output": exported["output"]}
        if isinstance(inputs, dict):
            tensors.update({f"batch.{k}": v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        else:
            tensors["batch.0"] = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
            targets = batch_targets(inputs)
            if targets is not None:
                tensors["batch.1"] = targets
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(tmp) / "check.safetensors"))
        tracker.client.log_artifact(tracker.run_id, str(Path(tmp) / "check.safetensors"), "model")


def consolidated_from_checkpoint(folder: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from one DeepSpeed checkpoint folder (a data-parallel plan's).

    Every file is checked against the checkpoint's manifest and unpickled weights-only
    (:func:`launchers.safe_load.verified_loading`): DeepSpeed's own converter reads them with
    ``torch.load``, which that context makes safe.
    """
    from launchers.safe_load import load_weights_only, verified_loading

    with verified_loading(folder):
        if zero_stage == 0:
            return load_weights_only(str(folder / "mp_rank_00_model_states.pt"), map_location="cpu")["module"]
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)


def export_run(uri: str, run_id: str, out: Path | None = None) -> str:
    """`orch export RUN_ID`: the newest checkpoint of a run, consolidated, written in the model's own
    format to ``out`` (if given) and logged to the run as weights and an MLflow model."""
    from omegaconf import OmegaConf

    from launchers.checkpoint import latest
    from launchers.storage import RemoteDir, is_remote, local_path
    from orchestrator.tracking import RunTracker, open_existing, reading
    from orchestrator.workload import resolve_workload
    from plans.errors import PlanError, Violation

    client = open_existing(uri)
    run = reading(uri, f"run {run_id}", lambda: client.get_run(run_id))
    params = run.data.params
    if params.get("plan.tp", "1") != "1" or params.get("plan.pp", "1") != "1":
        raise PlanError([Violation("run", run_id, f"was trained with tp={params.get('plan.tp')} and "
                                   f"pp={params.get('plan.pp')}; only data-parallel checkpoints are consolidated.",
                                   "load the checkpoint with the same plan to use it")])
    checkpoint_dir = params.get("train.checkpoint_dir", "checkpoints")
    record = latest(checkpoint_dir)
    if record is None or record.run_id != run_id:
        raise PlanError([Violation("train.checkpoint_dir", str(checkpoint_dir),
                                   f"holds no checkpoint of run {run_id} (run the export where it was trained).",
                                   "export from the directory the run was started in, or train with "
                                   "train.checkpoint_every > 0")])
    config = OmegaConf.create(Path(client.download_artifacts(run_id, "config/resolved.yaml")).read_text())
    resolved = OmegaConf.to_container(config, resolve=True)
    workload = resolve_workload(resolved["model"], resolved["objective"], resolved["data"])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(local_path(checkpoint_dir)) / record.tag
        if is_remote(checkpoint_dir):
            folder = Path(tmp) / record.tag
            RemoteDir(checkpoint_dir).download(record.tag, folder)
        state = consolidated_from_checkpoint(folder, int(params.get("plan.zero_stage", 0)))
    model = build_trained(workload, state)
    if out is not None:
        save_weights(model, out)
    tracker = RunTracker(client, run_id, run.info.experiment_id, uri)
    _log_model(tracker, model)
    return record.tag


def _log_model(tracker, model: torch.nn.Module) -> None:
    """The weights in the model's own format and an MLflow model directory (``runs:/<run>/model/mlflow_model``)."""
    import mlflow.pytorch

    with tempfile.TemporaryDirectory() as tmp:
        weights = save_weights(model, Path(tmp) / "weights")
        tracker.client.log_artifacts(tracker.run_id, str(weights), "model/weights")
        # MLflow's pickle format: it loads for any model and batch shape (the "pt2" format needs an
        # example input and fixes its shapes). Loading it unpickles; model/weights is the safe copy.
        mlflow.pytorch.save_model(model, str(Path(tmp) / "mlflow_model"), serialization_format="pickle")
        tracker.client.log_artifacts(tracker.run_id, str(Path(tmp) / "mlflow_model"), "model/mlflow_model")
