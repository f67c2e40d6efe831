"""`orch <command> [hydra overrides]`: the command picks a Hydra app, the rest is Hydra's.

Hydra owns ``sys.argv`` once a command is chosen, so overrides, ``--multirun``, ``--cfg job``
and ``--help`` all behave as in any Hydra app.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from launchers.ray_auth import use_token_auth_if_available
from orchestrator.config import register_configs, to_typed
from orchestrator.credentials import move_argv_credentials, protect_config, redact_text
from orchestrator.exits import EXIT_USAGE, exit_code, run_command
from orchestrator.signals import stopped_by_signals
from plans.errors import OrchError

register_configs()

USAGE = """usage: orch <command> [overrides...]

commands:
  train    train the declared run on Ray with DeepSpeed, tracked in MLflow
  check    predict per-device memory of the plan and say whether it fits [--json]
  tune     rank the plans that fit by predicted step time (tune.trials=N: confirm the N best
           with short real runs) and write the winner to ./tuned_plans/plan/ [--json]
  config   print the composed config (same overrides as train)
  runs     list recent runs of tracking.experiment
  report   RUN_ID [--out DIR]: summary of a run and its plots (loss, throughput, memory)
  export   RUN_ID [--out DIR]: the run's newest checkpoint as the model's own weights and an MLflow model

exit codes: 0 success; 1 the plan does not fit (check), training failed, or an internal error
(its traceback goes to a log file whose path is printed); 2 invalid input (config, plan, paths).
--verbose prints tracebacks (as HYDRA_FULL_ERROR=1 does).
Overrides are Hydra's: key=value, group=option, --multirun a=1,2. See README.md.
"""


def _fail(error: OrchError) -> None:
    print(redact_text(f"error: {error}"), file=sys.stderr)
    sys.exit(exit_code(error))


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def train_app(cfg: DictConfig) -> float:
    """Train; return ``train.sweep_metric`` to Hydra (what an optimizing sweeper minimizes)."""
    protect_config(cfg)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from orchestrator.driver import run_training
    from orchestrator.sweeps import child_tags, record_job_run

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        typed, model_cfg, yaml = to_typed(cfg)
        result = run_training(typed, model_cfg, yaml, tags=child_tags())
        if sweeping:
            record_job_run(int(HydraConfig.get().job.num), result.run_id)
        return sweep_value(result, typed.train.sweep_metric)
    except OrchError as error:
        if sweeping:  # the sweeper records a failed job and goes on (Optuna: a failed trial)
            print(redact_text(f"error: job {HydraConfig.get().job.num} failed: {error}"), file=sys.stderr)
            raise
        _fail(error)


def sweep_value(result, metric: str) -> float:
    """The run's final ``metric``: its last logged value."""
    last = result.reports[-1][0] if result.reports else {}
    if metric not in last:
        from plans.errors import PlanError, Violation

        raise PlanError([Violation("train.sweep_metric", metric, "the run logged no such metric at its end "
                                   f"(it logged: {', '.join(sorted(k for k in last if k != 'step'))}).",
                                   "name one of those, or set train.eval_batches > 0 for eval_loss")])
    return float(last[metric])


# Set by main() from `--json`, which Hydra itself would reject.
_OPTIONS: dict = {"json": False, "run_id": None, "out": None}


def _stdout_for_json_only() -> contextlib.AbstractContextManager:
    """With --json, stdout carries the JSON document only: whatever the libraries print meanwhile
    (DeepSpeed's logger writes to stdout when the pipeline partitioner imports it) and the tuning
    trials' progress go to stderr."""
    return contextlib.redirect_stdout(sys.stderr) if _OPTIONS["json"] else contextlib.nullcontext()


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def check_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    import json

    from orchestrator.checking import check_document, check_run, live_cluster, render

    try:
        typed, model_cfg, _ = to_typed(cfg)
        with _stdout_for_json_only(), live_cluster(typed) as (cluster, notes):
            estimate, _ = check_run(typed, model_cfg, cluster)
    except OrchError as error:
        _fail(error)
    if _OPTIONS["json"]:
        print(json.dumps(check_document(estimate, cluster, notes), indent=2))
    else:
        print(render(estimate, cluster, notes))
    if not estimate.feasible:
        sys.exit(1)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def tune_app(cfg: DictConfig) -> None:
    protect_config(cfg)

    from orchestrator.tuning import render, to_json_text, tune

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        typed, model_cfg, _ = to_typed(cfg)
        with _stdout_for_json_only():
            result = tune(typed, model_cfg)
    except OrchError as error:
        _fail(error)
    print(to_json_text(result, typed.tune.top_k) if _OPTIONS["json"] else render(result, typed.tune.top_k))


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def config_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    print(redact_text(OmegaConf.to_yaml(cfg, resolve=True)))  # cluster.address may hold a password


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def runs_app(cfg: DictConfig) -> None:
    from orchestrator.report import runs_command

    protect_config(cfg)
    try:
        print(runs_command(cfg.tracking.uri, cfg.tracking.experiment))
    except OrchError as error:
        _fail(error)


def _required_run_id(command: str) -> str:
    """The RUN_ID argument of `orch report` / `orch export`; exit 2 naming the usage without one."""
    run_id = _OPTIONS["run_id"]
    if not run_id:
        print(f"error: orch {command} needs a run id: orch {command} RUN_ID [--out DIR] [tracking.uri=...]",
              file=sys.stderr)
        sys.exit(EXIT_USAGE)
    return run_id


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def report_app(cfg: DictConfig) -> None:
    from pathlib import Path

    from orchestrator.report import report_command

    protect_config(cfg)
    run_id = _required_run_id("report")
    try:
        text, plots = report_command(cfg.tracking.uri, run_id, Path(_OPTIONS["out"] or f"reports/{run_id}"))
    except OrchError as error:
        _fail(error)
    print(text)
    for path in plots:
        print(f"wrote {path}")


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def export_app(cfg: DictConfig) -> None:
    from pathlib import Path

    from orchestrator.export import export_run

    protect_config(cfg)
    run_id = _required_run_id("export")
    try:
        tag = export_run(cfg.tracking.uri, run_id, Path(_OPTIONS["out"]) if _OPTIONS["out"] else None)
    except OrchError as error:
        _fail(error)
    print(f"exported {tag} of run {run_id}: runs:/{run_id}/model/mlflow_model"
          + (f", weights in {_OPTIONS['out']}" if _OPTIONS["out"] else ""))


COMMANDS = {"train": train_app, "check": check_app, "tune": tune_app, "config": config_app, "runs": runs_app,
            "report": report_app, "export": export_app}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    # As `python -m` does: a model, objective or data class in the working directory is importable
    # by its dotted path (local Ray workers inherit the driver's sys.path).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _OPTIONS["json"] = "--json" in rest
    verbose = "--verbose" in rest
    rest = [a for a in rest if a not in ("--json", "--verbose")]
    if "--out" in rest:  # orch report RUN_ID --out DIR
        i = rest.index("--out")
        _OPTIONS["out"] = rest[i + 1] if i + 1 < len(rest) else None
        rest = rest[:i] + rest[i + 2:]
    if command in ("report", "export"):
        plain = [a for a in rest if "=" not in a and not a.startswith("-")]
        _OPTIONS["run_id"] = plain[0] if plain else None
        rest = [a for a in rest if a not in plain[:1]]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    use_token_auth_if_available()
    try:
        rest = move_argv_credentials(rest)
    except OrchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    sys.argv = [f"orch-{command}", *rest]
    from orchestrator import sweeps

    sweeps.command = command
    with stopped_by_signals():
        return run_command(COMMANDS[command], command, verbose=verbose)
