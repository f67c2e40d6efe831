"""`orch calibrate`: measure a cluster's speeds once and write them as a cluster profile.

The profile is a cluster option like the shipped ones (``tuned_plans/cluster/<calibrate.name>.yaml``
by default, beside the plans `orch tune` writes): the cluster as declared, plus a ``measured``
section (:class:`orch.plans.spec.MeasuredSpeeds`) that `orch check`, `orch tune` and `orch train`
then price plans at (:func:`orch.plans.step_time.profile.cluster_speeds`). The probes are the
tuner's calibration (:mod:`orch.launchers.calibration`), run on the workers as training places
them, at the composed model's matmul shapes, never read from its cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import re
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

from orch import conf
from orch.config import RunConfig
from orch.plans.errors import PlanError, Violation
from orch.plans.spec import ClusterSpec, MeasuredSpeeds, PhaseObservation, RunObservation
from orch.plans.step_time.cost_model import Speeds
from orch.plans.step_time.profile import measured_values
from orch.plans.storage.locations import is_remote, unwritable_reason, write_whole

PROFILES_DIR = Path("tuned_plans")
"""The config directory profiles go to by default: ``tuned_plans/cluster/<name>.yaml``, so one
``--config-dir tuned_plans`` selects a tuned plan and a measured cluster alike."""

PROFILE_HEADER = "# Written by `orch calibrate`"
"""How every profile begins: what an existing file must begin with to be replaced."""

_OUT_FIX = "calibrate.out=DIR/cluster/NAME.yaml"

_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

_NOT_WRITTEN = ("address", "measured")
"""Cluster fields a profile leaves out: the address is how this command reached the cluster (pass
it, or RAY_ADDRESS, as to any command), and ``measured`` is written from the new measurement."""


def profile_path(cfg: RunConfig) -> Path:
    if cfg.calibrate.out:
        return Path(cfg.calibrate.out).expanduser()
    return PROFILES_DIR / "cluster" / f"{cfg.calibrate.name}.yaml"


def _field(cfg: RunConfig) -> tuple[str, str]:
    return ("calibrate.out", cfg.calibrate.out) if cfg.calibrate.out else ("calibrate.name", cfg.calibrate.name)


def check_profile_file(cfg: RunConfig) -> None:
    """Refuse, before anything is measured, a profile that would be written where it must not be:
    a name that is not plain, a URI, a path inside the installed package, a directory, an existing
    file `orch calibrate` did not write, a name a shipped cluster option takes (Hydra finds the
    package's option first), or a directory this user cannot write to."""
    from hydra.core.config_store import ConfigStore

    from orch.tune.plan_file import package_dirs

    name, value = _field(cfg)
    if not _PLAIN_NAME.fullmatch(cfg.calibrate.name):
        raise PlanError([Violation("calibrate.name", cfg.calibrate.name, "is not a plain name: the profile is written "
                                   f"to {PROFILES_DIR}/cluster/<calibrate.name>.yaml and selected as "
                                   "cluster=<calibrate.name>.", "use letters, digits, '_' and '-' only "
                                   "(calibrate.name=lab_a100), or calibrate.out=PATH")])
    if cfg.calibrate.out and is_remote(cfg.calibrate.out):
        raise PlanError([Violation(name, value, "is a URI; a cluster profile is a config file Hydra reads from a "
                                   "local --config-dir.", f"write it to a local file: {_OUT_FIX}")])
    path = profile_path(cfg)
    real = Path(os.path.realpath(path))
    for package in package_dirs():
        if real.is_relative_to(package):
            raise PlanError([Violation(name, value, f"is inside the installed orch package ({package}), whose files "
                                       "every command reads; orch calibrate never writes there.",
                                       f"leave calibrate.out unset for ./{PROFILES_DIR}/cluster/<calibrate.name>.yaml, "
                                       "or calibrate.out=DIR/cluster/NAME.yaml")])
    if real.is_dir():
        raise PlanError([Violation(name, value, "is a directory, not a profile file.",
                                   f"name a file: {_OUT_FIX}")])
    if real.exists() and not _begins_with_header(real):
        raise PlanError([Violation(name, value, f"is an existing file that orch calibrate did not write (it does not "
                                   f"begin with {PROFILE_HEADER!r}); it is left as it is.",
                                   "name a new file, or move that one away first if it should be replaced")])
    shipped = Path(conf.__file__).resolve().parent / "cluster" / path.name
    registered = path.name in ConfigStore.instance().repo.get("cluster", {})
    if path.parent.name == "cluster" and (shipped.exists() or registered):
        raise PlanError([Violation(name, value, f"cluster={path.stem} names a cluster shipped with orch; the profile "
                                   "could not be selected by that name.", "choose another name (calibrate.name=...)")])
    if why := unwritable_reason(real.parent):
        raise PlanError([Violation(name, value, f"the profile cannot be written to {real}: {why}.",
                                   f"write it to a directory this user can write: {_OUT_FIX}")])


def _begins_with_header(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(len(PROFILE_HEADER)) == PROFILE_HEADER
    except (OSError, UnicodeDecodeError):
        return False


@dataclass
class Profile:
    """What `orch calibrate` measured and where it wrote it."""

    path: Path
    cluster: ClusterSpec
    measured: MeasuredSpeeds
    declared: Speeds
    speeds: Speeds
    seconds: float
    notes: list[str]
    references: list = dataclasses.field(default_factory=list)
    """What became of each reference run (:class:`orch.reference_runs.ReferenceOutcome`)."""


def profile_text(cluster: ClusterSpec, measured: MeasuredSpeeds, path: Path) -> str:
    """The profile file: a header saying what it is and how to use it, the cluster's declared
    fields (unset speeds left out) and the measured section."""
    declared = {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(cluster).items()
                if k not in _NOT_WRITTEN and v is not None}
    doc = {"defaults": ["cluster_schema", "_self_"], **declared, "measured": measured_values(measured)}
    config_dir = path.parent.parent if path.parent.name == "cluster" else None
    use = (f"orch check --config-dir {config_dir} cluster={path.stem} (orch tune and orch train alike)"
           if config_dir is not None else "place it in DIR/cluster/ and pass --config-dir DIR cluster=NAME")
    header = [f"{PROFILE_HEADER} at {measured.measured_at}: the cluster as declared, with the speeds",
              f"# measured on its {measured.workers} worker(s) (`measured`). Plans are priced at these speeds.",
              f"# Use it: {use}",
              "# cluster.address is not stored: pass it (or RAY_ADDRESS) as to any command. Measure again",
              "# after the hardware, drivers or torch change: orch calibrate."]
    return "\n".join(header) + "\n" + OmegaConf.to_yaml(OmegaConf.create(doc))


def calibrate_cluster(cfg: RunConfig, model_cfg: dict, *, err=None) -> Profile:
    """Measure the cluster on its workers, write the profile, then train the reference runs and
    write it again with their corrections; see the module docstring."""
    from orch.checking import live_cluster
    from orch.launchers.ray_session import ray_session
    from orch.launchers.worker_group import job_env
    from orch.plans.model.workload import data_task_cpus
    from orch.reference_runs import reference_plans, train_references
    from orch.run.early_ray import uses_object_store
    from orch.tune.search import checked_workload, measure_cluster, prepare

    err = err or sys.stderr
    workload = checked_workload(cfg, model_cfg)
    check_profile_file(cfg)
    references = reference_plans(cfg)
    path = profile_path(cfg)
    with ExitStack() as stack:
        cluster, notes = stack.enter_context(live_cluster(cfg))
        space, ctx = prepare(cfg, model_cfg, cluster, workload)
        stack.enter_context(ray_session(cfg.cluster.address, worker_cpus=cluster.world_size * cluster.cpus_per_worker,
                                        data_cpus=data_task_cpus(workload.data) if references else 0.0,
                                        object_store_gib=cfg.cluster.object_store_memory_gib,
                                        connect_timeout_s=cfg.cluster.connect_timeout_s,
                                        worker_env=job_env(cluster.accelerator, cfg.train),
                                        object_store=bool(references) and uses_object_store(cfg)))
        print(f"calibrate: measuring {cluster.nodes} node(s) x {cluster.devices_per_node} "
              f"{cluster.accelerator.value} worker(s) on Ray", file=err, flush=True)
        started = time.perf_counter()
        measured_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        calibration = measure_cluster(cfg, cluster, space, ctx, use_cache=False)
        seconds = time.perf_counter() - started
        if calibration.disturbed:
            from orch.launchers.calibration import disturbed_note

            notes = [*notes, disturbed_note(calibration.disturbed)]
        measured = _measured_section(cfg, calibration, ctx, measured_at)
        profiled = dataclasses.replace(cluster, measured=None)
        # Written before the reference runs: a run that fails or is interrupted loses no measurement.
        _write_profile(cfg, path, profiled, measured)
        outcomes = train_references(cfg, model_cfg, references, measured, workload=workload, err=err)
    observed = [outcome.observation for outcome in outcomes if outcome.observation is not None]
    if observed:
        measured = dataclasses.replace(measured, runs=[*measured.runs, *observed])
        _write_profile(cfg, path, profiled, measured)
    return Profile(path=path, cluster=profiled, measured=measured,
                   declared=Speeds.declared(cluster, cfg.plan.precision), speeds=calibration.speeds,
                   seconds=seconds, notes=notes, references=outcomes)


def _measured_section(cfg: RunConfig, calibration, ctx, measured_at: str) -> MeasuredSpeeds:
    import ray
    import torch

    from orch.plans.step_time.profile import measured_section
    from orch.tune.search import matmul_shape

    versions = {"orch": metadata.version("orch"), "torch": str(torch.__version__), "ray": ray.__version__}
    return measured_section(calibration.speeds, precision=cfg.plan.precision, matmul_shape=matmul_shape(ctx.probe),
                            measured_at=measured_at, hosts=list(calibration.hosts), nodes=calibration.nodes,
                            versions=versions, sources=calibration.sources)


def _write_profile(cfg: RunConfig, path: Path, cluster: ClusterSpec, measured: MeasuredSpeeds) -> None:
    check_profile_file(cfg)  # again: the file may have appeared while the probes ran
    try:
        write_whole(path, profile_text(cluster, measured, path))
    except OSError as error:
        name, value = _field(cfg)
        raise PlanError([Violation(name, value, f"the profile could not be written to {path}: "
                                   f"{error.strerror or error}.", f"write it elsewhere: {_OUT_FIX}")]) from None


def _comparison_rows(declared: Speeds, measured: Speeds, sources: dict[str, str]) -> list[tuple[str, float, float]]:
    """(what, declared, measured) for each speed the calibration measured, in the units shown."""
    rows = [(f"matmul TFLOP/s at {height:,} rows", declared.tflops_at(height), tflops)
            for height, tflops in measured.matmul_tflops]
    if not sources.get("attention_share", "declared").startswith("declared"):
        rows.append(("attention's FLOP rate over the matmuls'", declared.attention_share, measured.attention_share))
    rows.append(("memory-bound kernels GB/s", declared.sustained_memory_gb_per_s, measured.sustained_memory_gb_per_s))
    if not sources["intra_node_gbps"].startswith("declared"):
        rows += [("all-reduce bus Gbit/s inside a node", declared.bus_gbps("intra"), measured.bus_gbps("intra")),
                 *((f"{kind.replace('_', '-')} bus Gbit/s inside a node", declared.bus_gbps("intra", collective=kind),
                    measured.bus_gbps("intra", collective=kind)) for kind in ("all_gather", "reduce_scatter")),
                 ("all-reduce step latency µs inside a node", declared.intra_latency_s * 1e6,
                  measured.intra_latency_s * 1e6)]
    if not sources["inter_node_gbps"].startswith("declared"):
        rows += [("all-reduce Gbit/s per rank across nodes", declared.inter_node_gbps * declared.inter_bus_efficiency,
                  measured.inter_node_gbps * measured.inter_bus_efficiency),
                 *((f"{kind.replace('_', '-')} Gbit/s per rank across nodes",
                    declared.inter_node_gbps * declared.inter_bus_efficiency * declared.collective_share("inter", kind),
                    measured.inter_node_gbps * measured.inter_bus_efficiency * measured.collective_share("inter", kind))
                   for kind in ("all_gather", "reduce_scatter")),
                 ("all-reduce step latency µs across nodes", declared.inter_latency_s * 1e6,
                  measured.inter_latency_s * 1e6)]
    rows += [("host link Gbit/s", declared.host_link_gbps, measured.host_link_gbps),
             ("host memory GB/s per node", declared.host_memory_gb_per_s, measured.host_memory_gb_per_s),
             ("fixed cost per op µs", declared.op_overhead_s * 1e6, measured.op_overhead_s * 1e6),
             ("share of a core per worker", declared.core_share, measured.core_share)]
    if not sources["host_optimizer_params_per_s"].startswith("declared"):
        rows.append(("host optimizer M params/s", declared.host_optimizer_params_per_s / 1e6,
                     measured.host_optimizer_params_per_s / 1e6))
    return rows


def render(profile: Profile) -> str:
    """What was measured, beside what the cluster declared, and how to use the profile."""
    lines = [f"note: {note}" for note in profile.notes]
    lines.append(f"measured {profile.measured.nodes} node(s), {profile.measured.workers} worker(s) in "
                 f"{profile.seconds:.1f} s "
                 f"({profile.measured.precision.value} matmuls of {profile.measured.matmul_shape[0]} x "
                 f"{profile.measured.matmul_shape[1]}, the model's largest repeated layer)")
    lines.append("")
    lines.append(f"  {'speed':<42} {'declared':>11} {'measured':>11}  measured/declared")
    for what, declared, measured in _comparison_rows(profile.declared, profile.speeds, profile.measured.sources):
        ratio = f"{measured / declared:.2f}" if declared else "n/a"
        lines.append(f"  {what:<42} {declared:>11.4g} {measured:>11.4g}  {ratio}")
    kept = [name for name, source in profile.measured.sources.items() if source.startswith("declared")]
    if kept:
        lines.append(f"  kept as declared (nothing here measures them): {', '.join(kept)}")
    if profile.references:
        lines.append("")
        lines += _reference_lines(profile.references)
    lines.append("")
    lines.append(f"written to {profile.path}")
    if profile.path.parent.name == "cluster":
        lines.append(f"use it: orch check --config-dir {profile.path.parent.parent} cluster={profile.path.stem} "
                     "(orch tune and orch train take the same)")
    return "\n".join(lines)


def _reference_lines(outcomes: list) -> list[str]:
    """Each reference run's phases, measured over predicted at the probes' speeds (the correction
    plans of its kind take), or why it was skipped."""
    lines = ["reference runs (measured / predicted at the speeds above, by phase; plans of the same kind take "
             "these corrections):"]
    for outcome in outcomes:
        label = outcome.reference.label
        if outcome.observation is None:
            lines.append(f"  {label:<52} skipped, {outcome.skipped}")
            continue
        ratios = ", ".join(f"{phase.phase} x{phase.measured_s / phase.predicted_s:.2f}"
                           for phase in outcome.observation.phases if phase.predicted_s > 0)
        lines.append(f"  {label:<52} {ratios}  (run {outcome.observation.run_id})")
        if outcome.observation.parts:
            lines.append(f"  {'':<52} its profiled step by kind of work: " + ", ".join(
                f"{part.phase} x{part.measured_s / part.predicted_s:.2f}" if part.predicted_s > 0
                else f"{part.phase} {part.measured_s:.3g} s (priced at nothing)" for part in outcome.observation.parts))
    return lines


def profile_file(config_dirs: list[Path], option: str) -> Path | None:
    """The file of the cluster option ``option`` in the user's config directories (Hydra's
    ``--config-dir`` and search path), or None when it is not in one (a shipped cluster)."""
    for directory in config_dirs:
        candidate = directory / "cluster" / f"{option}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _run_plan(params: dict[str, str]) -> str:
    keys = ("engine", "dp", "tp", "pp", "zero_stage", "offload_optimizer", "activation_checkpointing",
            "recompute_every_n_layers", "micro_batch_size", "grad_accum_steps", "precision")
    return " ".join(f"{key}={params[f'plan.{key}']}" for key in keys if f"plan.{key}" in params)


def observe_run(client, run_id: str, measured: MeasuredSpeeds, *, reference: bool = False) -> RunObservation:
    """A finished run's phases against the profile's uncorrected prediction of them; refused when
    the run was not priced at this profile, timed no phase, or is recorded already."""
    import json

    from mlflow.exceptions import MlflowException

    from orch.plans.step_time.phases import PHASES_VERSION
    from orch.tracking.step_prediction import PREDICTED_STEP_PARAM, part_comparisons, phase_comparisons

    def refuse(why: str, fix: str) -> PlanError:
        return PlanError([Violation("--from-run", run_id, why, fix)])

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise refuse("is not a run of this tracking store.", "pass a run ID `orch runs` lists, with the "
                     "tracking.uri it was tracked in") from None
    params = run.data.params
    priced_at = params.get("cluster.measured.measured_at")
    if priced_at != measured.measured_at:
        raise refuse(f"was priced at {'the profile measured at ' + priced_at if priced_at else 'declared speeds'}, "
                     f"not at this profile (measured at {measured.measured_at}): its predicted parts cannot "
                     "correct this profile's.", "train with this profile (--config-dir DIR cluster=NAME) and pass "
                     "that run")
    if any(recorded.run_id == run_id for recorded in measured.runs):
        raise refuse("is recorded in the profile already.", "pass another finished run")
    comparisons = phase_comparisons(client, run_id, params, run.data.metrics)
    if not comparisons:
        raise refuse("timed no phase of its steps (it stopped before its first report, or ran before orch timed "
                     "phases).", "train again with this profile and pass that run")
    # The run's prediction included the profile's corrections of the time: this records the
    # prediction without them, so that corrections never compound.
    applied = json.loads(params.get(f"{PREDICTED_STEP_PARAM}.phase_scale", "{}"))
    phases = [PhaseObservation(phase=c.name, predicted_s=c.predicted_s / applied.get(c.name, 1.0),
                               measured_s=c.measured_s) for c in comparisons if c.predicted_s > 0]
    parts = [PhaseObservation(phase=c.name, predicted_s=c.predicted_s, measured_s=c.measured_s)
             for c in part_comparisons(params, run.data.metrics, uncorrected=True)]
    recorded_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return RunObservation(run_id=run_id, plan=_run_plan(params), recorded_at=recorded_at, phases=phases,
                          kind=params.get(f"{PREDICTED_STEP_PARAM}.kind", ""), reference=reference, parts=parts,
                          phases_version=PHASES_VERSION)


def add_run(cfg: RunConfig, run_id: str, path: Path | None) -> tuple[Path, RunObservation, MeasuredSpeeds]:
    """Record ``run_id``'s phases in the profile the command composed (its file ``path``) and
    rewrite the file; returns the file, the observation and the profile's new measured section."""
    from orch.tracking.store import open_existing

    measured = cfg.cluster.measured
    option_fix = "select the profile `orch calibrate` wrote: --config-dir tuned_plans cluster=calibrated"
    if measured is None:
        raise PlanError([Violation("cluster", "(no cluster.measured)", "is not a cluster profile: --from-run "
                                   "corrects the speeds `orch calibrate` measured.", option_fix)])
    if path is None or not _begins_with_header(path):
        raise PlanError([Violation("cluster", str(path or "(a shipped cluster)"), "is not a file `orch calibrate` "
                                   "wrote in a --config-dir; it is left as it is.", option_fix)])
    client = open_existing(cfg.tracking.uri)
    observation = observe_run(client, run_id, measured)
    updated = dataclasses.replace(measured, runs=[*measured.runs, observation])
    write_whole(path, profile_text(dataclasses.replace(cfg.cluster, measured=None), updated, path))
    return path, observation, updated


def render_added(path: Path, observation: RunObservation, measured: MeasuredSpeeds) -> str:
    from orch.plans.step_time.profile import current_runs, run_corrections

    corrections = run_corrections(measured)
    lines = [f"run {observation.run_id} ({observation.plan}), by phase:"]
    for phase in observation.phases:
        lines.append(f"  {phase.phase:<20} predicted {phase.predicted_s:.4g} s  measured {phase.measured_s:.4g} s  "
                     f"measured / predicted {phase.measured_s / phase.predicted_s:.2f}")
    lines.append(f"the profile's corrections now ({len(current_runs(measured.runs))} run(s), the median per phase): "
                 + ", ".join(f"{phase} x{scale:.2f}" for phase, scale in sorted(corrections.items())))
    lines.append(f"written to {path}")
    return "\n".join(lines)
