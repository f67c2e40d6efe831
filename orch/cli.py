"""`orch <command> [hydra overrides]`: the command picks a Hydra app, the rest is Hydra's.

Hydra owns ``sys.argv`` once a command is chosen, so overrides, ``--multirun``, ``--cfg job``
and ``--help`` all behave as in any Hydra app.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from orch.config import register_configs, to_typed
from orch.credentials import move_argv_credentials, protect_config, redact_text, refuse_secret_overrides
from orch.exits import (
    EXIT_BROKEN_PIPE,
    EXIT_USAGE,
    Reported,
    exit_code,
    print_json_error,
    run_command,
    stdout_to_devnull,
)
from orch.launchers.ray_auth import use_token_auth_if_available
from orch.model_sources import prefer_command_line_source
from orch.plans.errors import OrchError
from orch.signals import stopped_by_signals
from orch.yaml_limits import check_config_dirs, config_dirs

register_configs()

# The shipped config tree: inside the package the command runs from, which is imported before the
# working directory joins sys.path, so a user's own `conf/` can neither shadow it nor be shadowed.
CONFIGS = "pkg://orch.conf"

USAGE = """usage: orch <command> [overrides...]

commands:
  train    train the declared run on Ray with DeepSpeed, tracked in MLflow
  check    predict per-device memory of the plan and say whether it fits [--json]
  tune     rank the plans that fit by predicted step time (tune.trials=N: confirm the N best
           with short real runs) and write the winner to ./tuned_plans/plan/ [--json]
  calibrate  measure the cluster's speeds on its workers (at the model's matmul shapes) and write them as
           a cluster profile, ./tuned_plans/cluster/calibrated.yaml, that check, tune and train then use;
           --from-run RUN_ID --config-dir tuned_plans cluster=calibrated: correct it by a finished run's phases
  config   print the composed config (same overrides as train)
  runs     list recent runs of tracking.experiment
  report   RUN_ID [--out DIR]: summary of a run and its plots (loss, throughput, memory)
  export   RUN_ID [--out DIR] [model overrides]: the run's newest checkpoint as the model's own weights and an
           MLflow model; the model is built from this command's config (as the run's `orch train` declared it)
  submit   [--tune] [--wait] overrides: check here, then run `orch train` (or tune) on a Ray cluster as a
           Ray Job (cluster.address=http://HEAD:8265 or RAY_ADDRESS), shipping the working directory
  jobs     the cluster's Ray Jobs;  logs JOB_ID [--follow];  stop JOB_ID

exit codes: 0 success; 1 the plan does not fit (check), training failed, or an internal error
(its traceback goes to a log file whose path is printed); 2 invalid input (config, plan, paths).
--verbose prints tracebacks (as HYDRA_FULL_ERROR=1 does).
Overrides are Hydra's: key=value, group=option, --multirun a=1,2. See README.md.
"""


def _ends_quietly_on_a_closed_stdout(app):
    """The command ends as a shell reports SIGPIPE (141) when the reader of its output is gone
    (``orch check | head -1``), without a word: raised inside the Hydra task, a BrokenPipeError made
    Hydra write "Error executing job with overrides: ..." to stderr before orch could catch it.
    The output is flushed here, so a write that fails at the end fails inside the task too."""

    @functools.wraps(app)
    def task(cfg: DictConfig):
        try:
            value = app(cfg)
            sys.stdout.flush()
            return value
        except BrokenPipeError:
            stdout_to_devnull()
            sys.exit(EXIT_BROKEN_PIPE)

    return task


def _fail(error: OrchError) -> None:
    print(redact_text(f"error: {error}"), file=sys.stderr)
    if _OPTIONS["json"]:
        print_json_error(error, str(error), exit_code(error))
    sys.exit(exit_code(error))


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def train_app(cfg: DictConfig) -> float | None:
    """Train; return ``train.sweep_metric`` to Hydra (what an optimizing sweeper minimizes)."""
    protect_config(cfg)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from orch.declared import declared_and_plan_violations
    from orch.plans.errors import PlanError
    from orch.run.resume import refuse_unusable_checkpoint_dir
    from orch.run.startup import Startup
    from orch.sweeps import child_tags, record_job_run, sweep_metric_problem
    from orch.tracking.local_store import local_store_violations

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        typed, model_cfg, yaml = to_typed(cfg)
        if sweeping and (problem := sweep_metric_problem(typed.train.sweep_metric, typed.train.eval_batches)):
            raise PlanError([problem])  # before any job trains
        if store_problems := local_store_violations(typed.tracking):  # before torch is imported or Ray started
            raise PlanError(store_problems + declared_and_plan_violations(typed))
        refuse_unusable_checkpoint_dir(typed)  # likewise
        # Start-up begins before the driver, and torch with it, is imported (an embedded Ray starts first).
        with storage_checks_bounded(typed), Startup.for_command(typed) as startup:
            result = startup.driver().run_training(typed, model_cfg, yaml, tags=child_tags(), startup=startup)
        if sweeping:
            record_job_run(int(HydraConfig.get().job.num), result.run_id)
        # Only a sweep's jobs return their metric: a single run is not judged by it.
        return sweep_value(result, typed.train.sweep_metric) if sweeping else None
    except OrchError as error:
        if sweeping:  # the sweeper records a failed job and goes on (Optuna: a failed trial)
            print(redact_text(f"error: job {HydraConfig.get().job.num} failed: {error}"), file=sys.stderr)
            raise Reported(error) from error
        _fail(error)


def sweep_value(result, metric: str) -> float:
    """The run's final ``metric``: its last logged value."""
    last = result.reports[-1][0].named_values() if result.reports else {}
    if metric not in last:
        from orch.plans.errors import PlanError, Violation

        raise PlanError([Violation("train.sweep_metric", metric, "the run logged no such metric at its end "
                                   f"(it logged: {', '.join(sorted(last))}).",
                                   "name one of those, or set train.eval_batches > 0 for eval_loss")])
    return float(last[metric])


def storage_checks_bounded(typed) -> contextlib.AbstractContextManager:
    """Every check of a storage location the command makes (train.checkpoint_dir, tune.out,
    data.paths) given up after ``cluster.connect_timeout_s`` (:mod:`orch.plans.storage.locations`)."""
    from orch.plans.storage.locations import probe_limit

    return probe_limit(typed.cluster.connect_timeout_s)


# Set by main() from `--json`, which Hydra itself would reject.
_OPTIONS: dict = {"json": False, "run_id": None, "out": None, "tune": False, "wait": False, "follow": False,
                  "overrides": [], "config_dir": None, "from_run": None}


def _stdout_for_json_only() -> contextlib.AbstractContextManager:
    """With --json, stdout carries the JSON document only: whatever the libraries print meanwhile
    (DeepSpeed's logger writes to stdout when the pipeline partitioner imports it) and the tuning
    trials' progress go to stderr."""
    return contextlib.redirect_stdout(sys.stderr) if _OPTIONS["json"] else contextlib.nullcontext()


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def check_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    import json

    from orch.checking import check_document, checked_run, live_cluster, render
    from orch.plans.step_time.prediction import declared_plan_step

    try:
        typed, model_cfg, _ = to_typed(cfg)
        with storage_checks_bounded(typed), _stdout_for_json_only(), live_cluster(typed) as (cluster, notes):
            estimate, facts, probe, _ = checked_run(typed, model_cfg, cluster)
            step = declared_plan_step(estimate.plan, cluster, typed.optim, probe, facts.param_count)
    except OrchError as error:
        _fail(error)
    if _OPTIONS["json"]:
        print(json.dumps(check_document(estimate, cluster, notes, step), indent=2))
    else:
        print(render(estimate, cluster, notes, step))
    if not estimate.feasible:
        sys.exit(1)


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def tune_app(cfg: DictConfig) -> None:
    protect_config(cfg)

    from orch.plans.errors import PlanError
    from orch.tracking.local_store import local_store_violations
    from orch.tune.plan_file import check_plan_file

    try:
        typed, model_cfg, _ = to_typed(cfg)
        # Before the search's imports: a refused plan file or store costs no torch import.
        if typed.tune.trials > 0 and (store_problems := local_store_violations(typed.tracking)):
            raise PlanError(store_problems)
        with storage_checks_bounded(typed):
            check_plan_file(typed)
    except OrchError as error:
        _fail(error)

    from orch.tune.result import render, to_json_text
    from orch.tune.search import tune

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        with storage_checks_bounded(typed), _stdout_for_json_only():
            result = tune(typed, model_cfg)
    except OrchError as error:
        _fail(error)
    print(to_json_text(result, typed.tune.top_k) if _OPTIONS["json"] else render(result, typed.tune.top_k))


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def calibrate_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    from orch.cluster_profile import calibrate_cluster, check_profile_file, render

    try:
        typed, model_cfg, _ = to_typed(cfg)
        if _OPTIONS["from_run"]:
            from hydra.core.hydra_config import HydraConfig

            from orch.cluster_profile import add_run, profile_file, render_added

            runtime = HydraConfig.get().runtime
            dirs = [Path(source.path) for source in runtime.config_sources if source.schema == "file"]
            added = add_run(typed, _OPTIONS["from_run"], profile_file(dirs, runtime.choices.get("cluster", "")))
            print(render_added(*added))
            return
        check_profile_file(typed)  # before the model is probed or Ray started
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        with storage_checks_bounded(typed):
            profile = calibrate_cluster(typed, model_cfg)
    except OrchError as error:
        _fail(error)
    print(render(profile))


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def config_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    prefer_command_line_source(cfg)  # the config the other commands run: the source the command line names
    print(redact_text(OmegaConf.to_yaml(cfg, resolve=True)))  # cluster.address may hold a password


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def runs_app(cfg: DictConfig) -> None:
    from orch.tracking.report import runs_command

    protect_config(cfg)
    try:
        print(runs_command(cfg.tracking.uri, cfg.tracking.experiment))
    except OrchError as error:
        _fail(error)


def _required_run_id(command: str, usage: str = "RUN_ID [--out DIR] [tracking.uri=...]") -> str:
    """The RUN_ID (JOB_ID) argument of `orch report`, `export`, `logs` and `stop`; exit 2 naming
    the usage without one."""
    run_id = _OPTIONS["run_id"]
    if not run_id:
        what = "job" if usage.startswith("JOB_ID") else "run"
        print(f"error: orch {command} needs a {what} id: orch {command} {usage}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    return run_id


def _out_directory(command: str, default: Path | None = None) -> Path | None:
    """``--out DIR`` (else ``default``, where the command writes without one): refused at once
    (exit 2) when it names something other than a directory, or one this user cannot write,
    before any run is read or written."""
    out = _OPTIONS["out"]
    if out is None and default is None:
        return None
    from orch.plans.errors import PlanError, Violation
    from orch.plans.storage.locations import unwritable_reason

    if out is not None and Path(out).exists() and not Path(out).is_dir():
        _fail(PlanError([Violation("--out", out, "is an existing file; orch "
                                   f"{command} writes a directory of files there.",
                                   "name a new or an existing directory")]))
    target = Path(out) if out is not None else default
    if why := unwritable_reason(target):
        _fail(PlanError([Violation("--out", str(target), f"orch {command} cannot write there: {why}.",
                                   "name a directory this user can write: --out DIR")]))
    return Path(out) if out is not None else None


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def report_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    run_id = _required_run_id("report")
    out = _out_directory("report", default=Path("reports"))
    from orch.tracking.report import report_command
    from orch.tracking.store import resolve_run_id

    try:
        run_id = resolve_run_id(cfg.tracking.uri, run_id)
        text, plots = report_command(cfg.tracking.uri, run_id, out or Path(f"reports/{run_id}"))
    except OrchError as error:
        _fail(error)
    print(text)
    for path in plots:
        print(f"wrote {path}")


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def export_app(cfg: DictConfig) -> None:
    protect_config(cfg)
    run_id = _required_run_id("export")
    out = _out_directory("export")
    from orch.export import export_run
    from orch.tracking.store import resolve_run_id

    try:
        # The model comes from this command's own config (its --config-dir and overrides), checked
        # against the checkpoint; nothing the run's tracked artifacts declare is instantiated.
        typed, model_cfg, _ = to_typed(cfg)
        with storage_checks_bounded(typed):
            run_id = resolve_run_id(cfg.tracking.uri, run_id)
            tag = export_run(cfg.tracking.uri, run_id, model_cfg, out)
    except OrchError as error:
        _fail(error)
    print(f"exported {tag} of run {run_id}: runs:/{run_id}/model/mlflow_model"
          + (f", weights in {_OPTIONS['out']}" if _OPTIONS["out"] else ""))


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def submit_app(cfg: DictConfig) -> None:
    """`orch submit [--tune] [--wait] overrides`: check here, then run as a Ray Job."""
    # As written, before protect_config moves a config file's credentials out (an interpolation
    # such as ${oc.env:NAME} stays unresolved: it resolves on the cluster, from its environment).
    written_uri = str(OmegaConf.to_container(cfg.tracking, resolve=False).get("uri"))
    protect_config(cfg)
    from orch import submit as jobs

    command = "tune" if _OPTIONS["tune"] else "train"
    overrides = _OPTIONS["overrides"]
    try:
        typed, model_cfg, _ = to_typed(cfg)
        address = jobs.jobs_address(typed)
        with storage_checks_bounded(typed):
            checked_submission(typed, model_cfg, address, command, overrides, written_uri)
        job = jobs.submission(command, overrides, typed.submit, _OPTIONS["config_dir"], Path.cwd())
        job_id = jobs.submit(address, job)
    except OrchError as error:
        _fail(error)
    print(jobs.submitted_message(job_id, address, job.entrypoint, address_given=bool(typed.cluster.address)))
    if _OPTIONS["wait"]:
        status = jobs.follow(address, job_id)
        print(f"job {job_id} ended {status}")
        sys.exit(jobs.EXIT_OF_STATUS.get(status, 1))


def checked_submission(typed, model_cfg: dict, address: str, command: str, overrides: list[str],
                       written_uri: str) -> None:
    """What `orch train` refuses, refused before submitting: the inputs, the paths a job cannot
    use, credentials the job would carry, and (for training) a plan the live cluster's nodes
    cannot hold; then the tracking server is checked as `orch train` checks it."""
    from orch import submit as jobs
    from orch.checking import checked_run
    from orch.inputs import input_violations
    from orch.plans.cluster_facts import reconcile
    from orch.plans.errors import PlanError

    problems = (input_violations(typed) + jobs.submit_violations(typed, command)
                + jobs.shipped_credentials(overrides, dict(typed.submit.env), written_uri))
    try:
        nodes = jobs.live_nodes(address, typed.cluster)
    except OrchError:
        if problems:  # what is wrong here is said first, whether or not the cluster answers
            raise PlanError(problems) from None
        raise
    cluster, violations, notes = reconcile(typed.cluster, nodes)
    if problems or violations:
        raise PlanError(problems + violations)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for line in jobs.check_tracking(typed):
        print(line, file=sys.stderr)
    if command == "train":
        estimate = checked_run(typed, model_cfg, cluster)[0]
        if not estimate.feasible and not typed.train.force:
            raise PlanError(estimate.violations)


def _job_address(cfg: DictConfig) -> str:
    from orch import submit as jobs

    typed, _, _ = to_typed(cfg)
    return jobs.jobs_address(typed)


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def jobs_app(cfg: DictConfig) -> None:
    protect_config(cfg)  # Hydra's copies of the overrides may hold cluster.address with a password
    from orch import submit as jobs

    try:
        print(jobs.jobs_table(_job_address(cfg)))
    except OrchError as error:
        _fail(error)


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def logs_app(cfg: DictConfig) -> None:
    protect_config(cfg)  # Hydra's copies of the overrides may hold cluster.address with a password
    from orch import submit as jobs

    job_id = _required_run_id("logs", "JOB_ID [--follow]")
    try:
        address = _job_address(cfg)
        if _OPTIONS["follow"]:
            print(f"job {job_id} ended {jobs.follow(address, job_id)}")
        else:
            print(jobs.logs(address, job_id), end="")
    except OrchError as error:
        _fail(error)


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="config")
@_ends_quietly_on_a_closed_stdout
def stop_app(cfg: DictConfig) -> None:
    protect_config(cfg)  # Hydra's copies of the overrides may hold cluster.address with a password
    from orch import submit as jobs

    job_id = _required_run_id("stop", "JOB_ID")
    try:
        print(f"job {job_id}: {jobs.stop(_job_address(cfg), job_id)}")
    except OrchError as error:
        _fail(error)


COMMANDS = {"train": train_app, "check": check_app, "tune": tune_app, "calibrate": calibrate_app,
            "config": config_app, "runs": runs_app,
            "report": report_app, "export": export_app, "submit": submit_app, "jobs": jobs_app, "logs": logs_app,
            "stop": stop_app}

QUIET_COMMANDS = ("check", "calibrate", "config", "runs", "report", "export", "jobs", "logs", "stop")
"""The commands that only read, or act on what already exists: Hydra writes no run directory for them.

By default Hydra records every command in ``outputs/<date>/<time>/`` (the composed config, the
overrides, a log file). For a run that trains, tunes or is submitted, that is its local record;
for `orch runs` or `orch check`, typed again and again while a plan is worked out, it is a
directory of copies in the user's working directory each time.
"""
_QUIET_OUTPUT = ("hydra.output_subdir=null", "hydra.run.dir=.")
_QUIET_LOGGING = ("~hydra.job_logging.handlers.file", "hydra.job_logging.root.handlers=[console]")
"""Hydra's own job logging without its log file: its console handler stays as it is."""


def _override_keys(args: list[str]) -> set[str]:
    """The keys the command line's overrides set (``+key=``, ``~key``, ``group=option``), flags left out."""
    return {arg.split("=", 1)[0].lstrip("+~") for arg in args if not arg.startswith("-")}


def _quiet_overrides(args: list[str]) -> list[str]:
    """The overrides that keep Hydra from writing anything for a quiet command. None where the
    command line asks for Hydra's record (``hydra.run.dir`` or ``hydra.output_subdir``), which it
    then gets as for any command, nor under ``--multirun``, whose sweep directories hold each job's;
    a job logging the user chose (``hydra/job_logging=...``) is left as they chose it."""
    keys = _override_keys(args)
    if "--multirun" in args or "-m" in args or keys & {"hydra.run.dir", "hydra.output_subdir"}:
        return []
    return [*_QUIET_OUTPUT, *(() if "hydra/job_logging" in keys else _QUIET_LOGGING)]


_LOGS_TO_STDERR = ("hydra.job_logging.handlers.console.stream=ext://sys.stderr",
                   "hydra.hydra_logging.handlers.console.stream=ext://sys.stderr")


def _json_overrides(args: list[str]) -> list[str]:
    """With --json, stdout carries the JSON document only, so Hydra's console handlers write the
    log lines to stderr. A StreamHandler holds the stdout it was made with, so the redirect around
    the work does not move them: a library's warning that reaches the root logger (transformers'
    gradient-checkpointing note) or ``hydra.verbose`` would otherwise come before the document.
    A logging configuration the user chose is left as they chose it."""
    keys = _override_keys(args)
    chosen = ("hydra/job_logging", "hydra/hydra_logging", "hydra.job_logging", "hydra.hydra_logging")
    if any(key.startswith(chosen) for key in keys):
        return []
    return list(_LOGS_TO_STDERR)


def _submitted_overrides(rest: list[str]) -> tuple[list[str], str | None]:
    """The Hydra overrides `orch submit` passes on to the job's `orch train`, and its --config-dir."""
    overrides, config_dir, skip = [], None, False
    for i, arg in enumerate(rest):
        if skip:
            skip = False
            continue
        if arg in ("--config-dir", "-cd"):
            config_dir, skip = (rest[i + 1] if i + 1 < len(rest) else None), True
        elif arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, config_dir


# Hydra's flags that take the next argument as their value (`--info` takes one only from its choices).
_HYDRA_VALUE_FLAGS = {"--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--cfg", "-c",
                      "--package", "-p", "--experimental-rerun"}
_HYDRA_INFO_FLAGS = {"--info", "-i"}
_HYDRA_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _flags_and_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's flags (each with its value) and the other arguments, each in the order given.

    Hydra parses its command line with argparse, whose overrides are one run of positional
    arguments: a flag after them is "unrecognized". Flags may come anywhere in an `orch` command
    (`orch check plan.zero_stage=2 --config-dir mine model=mine`), so they are handed to Hydra first.
    """
    flags, others = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        takes_value = arg in _HYDRA_VALUE_FLAGS or (
            arg in _HYDRA_INFO_FLAGS and i + 1 < len(args) and args[i + 1] in _HYDRA_INFO_CHOICES)
        if takes_value:
            flags += args[i:i + 2]
            i += 2
            continue
        (flags if arg.startswith("-") else others).append(arg)
        i += 1
    return flags, others


def _user_code_importable() -> None:
    """Put the working directory first on ``sys.path``, as `python -m` does and as Ray does in its
    workers: a model, objective or data class next to the command is importable by its dotted path,
    and resolves to the same file in the driver and the workers.

    orch's one package is imported before, and its parts (planner, launchers, workloads, configs)
    are its sub-packages, so that a folder of the user's named like one of them (``plans/``,
    ``workloads/``, ``launchers/``, ``conf/`` as Hydra's tutorials name a config directory) is the
    user's, here and on the workers, which import the driver's working directory first.
    """
    import importlib

    importlib.import_module("orch.conf")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    _user_code_importable()
    _OPTIONS["json"] = "--json" in rest
    verbose = "--verbose" in rest
    rest = [a for a in rest if a not in ("--json", "--verbose")]
    if "--out" in rest:  # orch report RUN_ID --out DIR
        i = rest.index("--out")
        _OPTIONS["out"] = rest[i + 1] if i + 1 < len(rest) else None
        rest = rest[:i] + rest[i + 2:]
    if "--from-run" in rest and command == "calibrate":  # orch calibrate --from-run RUN_ID
        i = rest.index("--from-run")
        _OPTIONS["from_run"] = rest[i + 1] if i + 1 < len(rest) else ""
        rest = rest[:i] + rest[i + 2:]
        if not _OPTIONS["from_run"] or "=" in _OPTIONS["from_run"]:
            print("error: --from-run needs the ID of a finished run (`orch runs` lists them). Fix: orch calibrate "
                  "--from-run RUN_ID --config-dir tuned_plans cluster=calibrated", file=sys.stderr)
            return EXIT_USAGE
    for flag in ("--tune", "--wait", "--follow"):
        _OPTIONS[flag[2:]] = flag in rest and command in ("submit", "logs")
        if _OPTIONS[flag[2:]]:
            rest = [a for a in rest if a != flag]
    flags, rest = _flags_and_overrides(rest)
    overrides = rest
    if command in ("report", "export", "logs", "stop"):
        plain = [a for a in rest if "=" not in a]
        _OPTIONS["run_id"] = plain[0] if plain else None
        rest = [a for a in rest if a not in plain[:1]]
    rest = flags + rest
    rest += [*(_quiet_overrides(rest) if command in QUIET_COMMANDS else ()),
             *(_json_overrides(rest) if _OPTIONS["json"] else ())]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    use_token_auth_if_available()
    try:  # before Hydra reads the command line: it records the overrides on disk first thing
        refuse_secret_overrides(overrides, command)
        rest = move_argv_credentials(rest)
        check_config_dirs(config_dirs(flags, overrides))  # before Hydra composes the user's files
    except OrchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if command == "submit":  # the job's command line, from the overrides without their credentials
        _OPTIONS["overrides"], _OPTIONS["config_dir"] = _submitted_overrides(rest)
    sys.argv = [f"orch-{command}", *rest]
    from orch import sweeps

    sweeps.command = command
    from orch.plans.storage.locations import exit_past_abandoned_checks

    try:
        with stopped_by_signals():
            code = run_command(COMMANDS[command], command, verbose=verbose, json_errors=_OPTIONS["json"])
    except SystemExit as exiting:
        exit_past_abandoned_checks(exiting.code)
        raise
    exit_past_abandoned_checks(code)
    return code
