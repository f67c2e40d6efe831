"""The short runs `orch calibrate` trains to correct the profile it measured (``calibrate.references``).

The probes time a cluster's kernels and links one at a time. A training step also runs its
engine's own work: DeepSpeed's ZeRO hooks, its bucketed gradient reductions and the gathers after
the step, FSDP2's per-block gathers, an optimizer stepping on the host, and ranks waiting on each
other at every collective. None of that is a speed a probe can time apart from the engine, so each
reference run trains the declared plan under one engine setting for a few steps, priced at the
profile just measured, and its timed phases against their prediction are recorded in the profile
as `orch calibrate --from-run` records a user's run. Plans of the same kind (engine, its settings,
where the optimizer steps: :func:`orch.plans.step_time.phases.correction_kind`) are then priced
with their engine's measured share, phase by phase.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orch.config import RunConfig
from orch.plans.errors import OrchError, PlanError, Violation
from orch.plans.spec import MeasuredSpeeds, PlanSpec, RunObservation

ENGINE_KEYS = ("engine", "zero_stage", "offload_optimizer", "offload_param", "fsdp")
"""The plan's keys that say how its engine runs: reset to their defaults before a reference's own
keys apply, so that each reference is the same kind whatever the declared plan's engine is."""

DEFAULT_REFERENCES = ({"engine": "deepspeed", "zero_stage": 0}, {"engine": "deepspeed", "zero_stage": 1},
                      {"engine": "deepspeed", "zero_stage": 2}, {"engine": "deepspeed", "zero_stage": 3},
                      {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"}, {"engine": "fsdp2"})
"""The references of ``calibrate.references=null``: every engine setting `orch tune` searches by default."""

MIN_STEPS = 4
"""Fewest steps a reference run may take: its later half is compared, and step 2 probes memory."""


@dataclass(frozen=True)
class Reference:
    """One reference run to train: its position in calibrate.references and its plan."""

    index: int
    changes: dict
    plan: PlanSpec

    @property
    def label(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.changes.items())


@dataclass
class ReferenceOutcome:
    """What became of one reference run: its observation, or why it was skipped."""

    reference: Reference
    observation: RunObservation | None = None
    skipped: str | None = None


def reference_plans(cfg: RunConfig) -> list[Reference]:
    """The declared plan under each of ``calibrate.references``; a key that is not a plan's, or a
    value it cannot take, is refused naming the entry (before anything is measured)."""
    field = "calibrate.references"
    changes_each = DEFAULT_REFERENCES if cfg.calibrate.references is None else cfg.calibrate.references
    if changes_each and cfg.calibrate.reference_steps < MIN_STEPS:
        raise PlanError([Violation("calibrate.reference_steps", cfg.calibrate.reference_steps,
                                   f"is below {MIN_STEPS}: a reference run's later half of steps is compared, and its "
                                   "step 2 probes memory.", f"set calibrate.reference_steps={MIN_STEPS} or more, "
                                   f"or {field}=[] to measure with the probes only")])
    if changes_each and not cfg.tracking.enabled:
        raise PlanError([Violation("tracking.enabled", False, "reference runs are read back from the tracking store "
                                   "(their timed phases), and tracking is off.", "leave tracking on, or set "
                                   f"{field}=[] to measure with the probes only")])
    defaults = PlanSpec()
    base = dataclasses.replace(cfg.plan, **{key: getattr(defaults, key) for key in ENGINE_KEYS})
    references = []
    for index, changes in enumerate(changes_each):
        changes = dict(changes)
        try:
            plan = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(base), changes))
        except OmegaConfBaseException as error:
            raise PlanError([Violation(f"{field}[{index}]", changes, f"is not a change of plan.* keys: "
                                       f"{str(error).splitlines()[0]}.", "name plan keys with values they take, "
                                       f"e.g. {field}=[{{engine:deepspeed,zero_stage:1}}]")]) from None
        references.append(Reference(index=index, changes=changes, plan=plan))
    return references


def reference_config(cfg: RunConfig, reference: Reference, measured: MeasuredSpeeds) -> RunConfig:
    """The run config of ``reference``: the declared run with its plan, priced at ``measured``, for
    calibrate.reference_steps steps, every step's phases timed but one profiled, nothing saved or
    evaluated."""
    from orch.tune.trials import measuring_run

    # Its last step but one runs under the profiler: the phases' kinds of work go into the profile
    # beside their corrections (RunObservation.parts); that step is left out of the timed ones.
    steps = cfg.calibrate.reference_steps
    train = measuring_run(cfg.train, steps, profile_steps=[steps - 1])
    tracking = dataclasses.replace(cfg.tracking, run_name=f"{cfg.tracking.run_name or 'calibrate'}-reference"
                                                           f"{reference.index}")
    return dataclasses.replace(cfg, plan=reference.plan, train=train, tracking=tracking,
                               cluster=dataclasses.replace(cfg.cluster, measured=measured))


def train_references(cfg: RunConfig, model_cfg: dict, references: list[Reference], measured: MeasuredSpeeds, *,
                     workload=None, err=None) -> list[ReferenceOutcome]:
    """Train each reference on the Ray this process is connected to and observe its phases against
    ``measured``'s prediction; a reference that does not fit, or fails, is skipped with its reason
    (the others still run)."""
    from orch.launchers.worker_pool import reusing_workers

    err = err or sys.stderr
    with reusing_workers():  # one reference's workers serve the next: their start-up is paid once
        return [_train_reference(cfg, model_cfg, reference, len(references), measured, workload, err)
                for reference in references]


def _train_reference(cfg: RunConfig, model_cfg: dict, reference: Reference, count: int, measured: MeasuredSpeeds,
                     workload, err) -> ReferenceOutcome:
    from orch.cluster_profile import observe_run
    from orch.run.driver import run_training
    from orch.tracking.store import open_existing

    outcome = ReferenceOutcome(reference)
    print(f"calibrate: reference run {reference.index + 1}/{count}: {reference.label}, "
          f"{cfg.calibrate.reference_steps} steps", file=err, flush=True)
    run_cfg = reference_config(cfg, reference, measured)
    yaml = OmegaConf.to_yaml(OmegaConf.create({"model": model_cfg, "plan": OmegaConf.structured(run_cfg.plan),
                                               "train": OmegaConf.structured(run_cfg.train)}))
    try:
        result = run_training(run_cfg, model_cfg, yaml, stream=err, workload=workload,
                              tags={"orch.calibrate.reference": reference.label})
    except Exception as error:  # contained: one reference that does not fit must not lose the profile
        first = str(error).strip().splitlines()
        kind = "does not fit" if isinstance(error, PlanError) else f"failed ({type(error).__name__})"
        outcome.skipped = f"{kind}: {first[0][:300] if first else ''}"
        print(f"calibrate: reference run {reference.index + 1} skipped, {outcome.skipped}", file=err, flush=True)
        return outcome
    try:
        outcome.observation = observe_run(open_existing(cfg.tracking.uri), result.run_id, measured, reference=True)
    except OrchError as error:
        outcome.skipped = f"not comparable: {str(error).strip().splitlines()[0][:300]}"
        print(f"calibrate: reference run {reference.index + 1} skipped, {outcome.skipped}", file=err, flush=True)
    return outcome
