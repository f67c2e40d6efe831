"""The trained model, out of the run: consolidated weights in the model's own format, logged to
the MLflow run as an MLflow model that ``mlflow.pytorch.load_model`` loads back.

A Hugging Face model is written with ``save_pretrained`` (safetensors); any other model as
``model.safetensors`` of its state dict. The engine's output on one held-out batch is logged
beside it (``model/check.safetensors``), so a reloaded model can be checked against it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from orch.plans.model.workload import Workload


def build_trained(workload: Workload, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model built on CPU with the consolidated weights (in fp32, whatever the training precision)."""
    return load_trained(workload.model_factory(), state)


def load_trained(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` with the consolidated weights loaded, in fp32 and in eval mode."""
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

    from orch.plans.model.workload import batch_targets

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


def export_run(uri: str, run_id: str, model_cfg: dict, out: Path | None = None) -> str:
    """`orch export RUN_ID`: the newest checkpoint of a run, consolidated, written in the model's own
    format to ``out`` (if given) and logged to the run as weights and an MLflow model.

    The model is built from ``model_cfg``, the exporting command's own config, never from the run's
    tracked artifacts: whoever can edit those (``config/resolved.yaml`` on a shared tracking server)
    must not choose what is instantiated here. Before it is built, ``model_cfg`` is compared with the
    model config the checkpoint's manifest records (the files verified against their digests), and
    after, its parameters with the manifest's; any difference is refused, naming it.
    """
    from orch.launchers.checkpoint import latest
    from orch.launchers.engines import engine_module
    from orch.launchers.manifest import verify
    from orch.launchers.storage import RemoteDir, location_violation
    from orch.models import model_factory, split_model_config
    from orch.plans.engines import engine_names
    from orch.plans.errors import PlanError, Violation
    from orch.plans.storage.locations import is_remote, local_path
    from orch.tracking.store import RunTracker, open_existing, reading

    client = open_existing(uri)
    run = reading(uri, f"run {run_id}", lambda: client.get_run(run_id))
    params = run.data.params
    engine = params.get("plan.engine", "deepspeed")
    if engine not in engine_names():
        raise PlanError([Violation("plan.engine", engine, f"is the engine run {run_id} records, which orch does not "
                                   "have.", f"export runs trained with one of {', '.join(engine_names())}")])
    hooks = engine_module(engine, "export")
    if why := hooks.export_refusal(params):
        raise PlanError([Violation("run", run_id, why, "load the checkpoint with the same plan to use it")])
    checkpoint_dir = params.get("train.checkpoint_dir", "checkpoints")
    if is_remote(checkpoint_dir) and (problem := location_violation(checkpoint_dir)):
        why, _, fix = problem.partition(" Fix: ")  # an unreachable store within cluster.connect_timeout_s
        raise PlanError([Violation("train.checkpoint_dir", checkpoint_dir, why, fix)])
    with _export_fix():
        record = latest(checkpoint_dir)
    if record is None or record.run_id != run_id:
        raise PlanError([Violation("train.checkpoint_dir", str(checkpoint_dir),
                                   f"holds no checkpoint of run {run_id} (run the export where it was trained).",
                                   "export from the directory the run was started in, or train with "
                                   "train.checkpoint_every > 0")])
    constructor_cfg, _ = split_model_config(model_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(local_path(checkpoint_dir)) / record.tag
        if is_remote(checkpoint_dir):
            folder = Path(tmp) / record.tag
            RemoteDir(checkpoint_dir).download(record.tag, folder)
        with _export_fix():
            manifest = verify(folder)  # every file, byte for byte
        where = f"{str(checkpoint_dir).rstrip('/')}/{record.tag}"
        saved = manifest.model or {}
        check_model_config(where, saved.get("config"), constructor_cfg)
        model = model_factory(constructor_cfg)()
        check_model_params(where, saved.get("params"), model)
        with _export_fix():
            state = hooks.consolidated_weights(folder, params)
    model = load_trained(model, state)
    if out is not None:
        save_weights(model, out)
    tracker = RunTracker(client, run_id, run.info.experiment_id, uri)
    _log_model(tracker, model)
    return record.tag


# Every checkpoint problem an export finds is fixed by exporting from intact checkpoints, not by
# anything about resuming (the fix the checkpoint errors carry for `orch train`).
_EXPORT_FIX = ("Fix: export only checkpoints this orchestrator wrote: run `orch export` where the run's "
               "train.checkpoint_dir holds them intact (or train again with train.checkpoint_every > 0)")


@contextlib.contextmanager
def _export_fix() -> Iterator[None]:
    """Checkpoint errors raised in the block, with the fix for an export."""
    from orch.launchers.checkpoint import CheckpointRecordError
    from orch.launchers.manifest import CheckpointIntegrityError
    from orch.launchers.safe_load import UnsafeCheckpointError

    try:
        yield
    except (CheckpointRecordError, CheckpointIntegrityError, UnsafeCheckpointError) as error:
        raise type(error)(f"{str(error).split(' Fix:')[0]} {_EXPORT_FIX}") from None


def as_recorded(constructor_cfg: dict) -> dict:
    """The model config as a checkpoint's manifest records it (:func:`orch.launchers.checkpoint.model_signature`)."""
    return json.loads(json.dumps(dict(constructor_cfg), default=str))


def check_model_config(where: str, saved: dict | None, constructor_cfg: dict) -> None:
    """Refuse a model config that differs from the one the checkpoint was written with, naming
    every differing ``model.*`` key; nothing is built. A checkpoint that records no model config
    (one written before manifests carried it) is checked by its weights alone."""
    from orch.plans.errors import PlanError, Violation

    if saved is None:
        return
    differences = _differences(saved, as_recorded(constructor_cfg), "model")
    if not differences:
        return
    raise PlanError([Violation(key, now, f"the checkpoint {where} was written by a model with {key}={_shown(then)}; "
                               "the model is built from this command's config, which must declare the model the run "
                               "was trained with.", _fix_for(key, then))
                     for key, then, now in differences])


def check_model_params(where: str, saved: dict | None, model: torch.nn.Module) -> None:
    """Refuse a built model whose parameter names and shapes differ from the checkpoint's."""
    from orch.plans.errors import PlanError, Violation

    if saved is None:
        return
    now = {name: list(p.shape) for name, p in model.named_parameters()}
    if now == saved:
        return
    name = next(n for n in sorted(set(saved) | set(now)) if saved.get(n) != now.get(n))
    raise PlanError([Violation("model", type(model).__name__,
                               f"its parameters differ from those of the checkpoint {where} ({name}: checkpoint "
                               f"{saved.get(name)}, model {now.get(name)}).",
                               "export with the model config and code the run was trained with")])


def _differences(saved, now, key: str) -> list[tuple[str, object, object]]:
    """``(dotted key, checkpoint's value, config's value)`` of each leaf that differs; of a section
    whose ``_target_`` differs, only that (its other keys are another callable's arguments)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        if saved.get("_target_") != now.get("_target_"):
            return [(f"{key}._target_", saved.get("_target_", _ABSENT), now.get("_target_", _ABSENT))]
        return [difference for name in sorted(set(saved) | set(now), key=str)
                for difference in _differences(saved.get(name, _ABSENT), now.get(name, _ABSENT), f"{key}.{name}")]
    return [] if saved == now else [(key, saved, now)]


class _Absent:
    def __repr__(self) -> str:
        return "(not set)"


_ABSENT = _Absent()


def _shown(value) -> str:
    return repr(value) if value is _ABSENT else json.dumps(value)


def _fix_for(key: str, then) -> str:
    """Export with the run's own config; the override that declares the checkpoint's value, when it
    is a plain one.

    A ``_target_`` or a structured value is never offered as an override to copy: it comes from the
    checkpoint directory, which is not authenticated, and only the user knows which model code is
    theirs."""
    same = "the same --config-dir, model option and model.* overrides as the run's `orch train`"
    if key.endswith("._target_") or not isinstance(then, (str, int, float, bool, type(None))):
        return f"export with {same}"
    return f"set {key}={_override_value(then)} (export with {same})"


def _override_value(value) -> str:
    """``value`` as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value) if not value.replace("_", "").replace("-", "").isalnum() else value
    return str(value)


# This project's packages and the distribution pyproject.toml installs them as.
_OWN_PACKAGES = {"orch": "orch"}


def model_requirements(model: torch.nn.Module) -> list[str]:
    """What loading the model back needs, pinned: MLflow's requirements for its pytorch flavor and
    the installed distribution of every class the model is made of (``orch`` for the built-in
    models, ``transformers``, ``torchvision`` or the user's own package).

    Stated, not left to MLflow: without them MLflow infers the requirements by loading the saved
    model in a subprocess, which took seconds of every run's end for the same answer. A class
    from a module no installed distribution provides (a script beside the config) adds nothing,
    as MLflow's inference would not find it either.
    """
    import mlflow.pytorch

    requirements = dict(r.split("==", 1) for r in mlflow.pytorch.get_default_pip_requirements())
    for package in sorted({type(module).__module__.split(".", 1)[0] for module in model.modules()}):
        for dist in _distributions_of(package):
            requirements.setdefault(dist, importlib.metadata.version(dist))
    return [f"{name}=={version}" for name, version in sorted(requirements.items())]


def _distributions_of(package: str) -> list[str]:
    """The installed distributions that provide the top-level ``package`` (none for a module of no
    distribution). Looked up by name first: scanning every distribution takes most of a second."""
    if package in _OWN_PACKAGES:
        names = [_OWN_PACKAGES[package]]
    else:
        names = [package, package.replace("_", "-")]
    for name in names:
        try:
            importlib.metadata.distribution(name)
            return [name]
        except importlib.metadata.PackageNotFoundError:
            continue
    if package in _OWN_PACKAGES or package in sys.stdlib_module_names or package == "__main__":
        return []
    return importlib.metadata.packages_distributions().get(package, [])


def _log_model(tracker, model: torch.nn.Module) -> None:
    """The weights in the model's own format and an MLflow model directory (``runs:/<run>/model/mlflow_model``)."""
    import mlflow.pytorch

    with tempfile.TemporaryDirectory() as tmp:
        weights = save_weights(model, Path(tmp) / "weights")
        tracker.client.log_artifacts(tracker.run_id, str(weights), "model/weights")
        # MLflow's pickle format: it loads for any model and batch shape (the "pt2" format needs an
        # example input and fixes its shapes). Loading it unpickles; model/weights is the safe copy.
        mlflow.pytorch.save_model(model, str(Path(tmp) / "mlflow_model"), serialization_format="pickle",
                                  pip_requirements=model_requirements(model))
        tracker.client.log_artifacts(tracker.run_id, str(Path(tmp) / "mlflow_model"), "model/mlflow_model")
