"""The plain runners' job, derived from the very config `orch train` composes for the same overrides.

Both sides of a comparison must train the same thing. Rather than restate the model, plan and
DeepSpeed config for the plain loop, the benchmark composes the Hydra config exactly as the CLI
does and derives the DeepSpeed config the way the driver does (`build_ds_config` of the
run's `optim_settings`, with the model's parameter count). `same_ds_config` then checks it
against the config the `orch` run logged to MLflow, so a drift between the two sides fails the
benchmark instead of skewing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_module

from bench.harness import orch_command
from orch.checking import check_run
from orch.config import register_configs, to_typed
from orch.launchers.engines.deepspeed.config import build_ds_config
from orch.models import split_model_config
from orch.plans.optim_settings import optim_settings


def plain_job(overrides: list[str]) -> dict:
    """Everything the plain loop (:mod:`plain_deepspeed`) needs, as JSON-able data."""
    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        cfg, model_cfg, _ = to_typed(compose("config", overrides=overrides))
    estimate, facts = check_run(cfg, model_cfg)
    plan = estimate.plan
    constructor, tp_layer_specs = split_model_config(model_cfg)
    if constructor.get("_target_") != "orch.workloads.gpt.GPT" or plan.tp != 1:
        raise ValueError("the side-by-side benchmarks train the built-in GPT (model=gpt) with plan.tp=1")
    return {
        "ds_config": build_ds_config(plan, optim_settings(plan, cfg.optim, cfg.train.steps),
                                     param_count=facts.param_count, tp_layer_specs=tp_layer_specs),
        "model": {k: v for k, v in constructor.items() if k != "_target_"},
        "seq_len": cfg.data["seq_len"], "data_path": cfg.data["path"], "val_fraction": cfg.data["val_fraction"],
        "dp": plan.dp, "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
        "steps": cfg.train.steps, "log_every": cfg.train.log_every, "seed": cfg.train.seed,
        "eval_batches": cfg.train.eval_batches, "world_size": plan.world_size,
    }


def write_job(job: dict, path: Path) -> Path:
    path.write_text(json.dumps(job, indent=1))
    return path


@dataclass(frozen=True)
class SameRun:
    """One run as both sides of a comparison get it: the plain runners' job, and the `orch train`
    command for the same overrides, tracked where :meth:`check` reads its DeepSpeed config back."""

    job: dict
    job_path: Path
    """Where the job was written, for the plain runner's ``--job``."""
    tracking_uri: str
    orch_cmd: list[str]

    def check(self) -> None:
        """Raise unless the `orch` run trained with the job's DeepSpeed config (:func:`same_ds_config`)."""
        same_ds_config(self.job, self.tracking_uri)


def same_run(overrides: list[str], work: Path) -> SameRun:
    """The plain job of ``overrides`` written to ``work``/job.json, and the `orch train` command for
    them tracked in ``work``/mlflow.db."""
    job = plain_job(overrides)
    tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    return SameRun(job, write_job(job, work / "job.json"), tracking_uri,
                   orch_command(*overrides, f"tracking.uri={tracking_uri}"))


def same_ds_config(job: dict, tracking_uri: str) -> None:
    """Raise unless the latest `orch` run in ``tracking_uri`` trained with the plain job's DeepSpeed config."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("orch")
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    theirs = json.loads(Path(client.download_artifacts(run.info.run_id, "config/deepspeed.json")).read_text())
    if theirs != job["ds_config"]:
        raise RuntimeError(f"orch trained with a different DeepSpeed config than the plain loop:\n{theirs}\n"
                           f"vs\n{job['ds_config']}")
