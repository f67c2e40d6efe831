"""An elastic run (``train.elastic``): when a worker is lost, wait a while for the plan's devices, and
when they do not come back, re-plan for the devices that survive and resume the last checkpoint there.

The re-plan is the tuner's search (:func:`orch.tune.search.prepare`, :func:`orch.plans.search.space.search`)
on the surviving devices, with the run's model, data, precision, engine and engine settings, keeping
its global batch (or the closest one ``train.elastic.batch_tolerance`` allows), among the plans the
last checkpoint can resume (:meth:`orch.plans.engines.base.EngineSpec.resume_problem`: DeepSpeed
changes dp through a universal checkpoint, DCP reshards dp and tp). The data position of a map-style
dataset is one shuffled order consumed ``global batch`` samples a step whatever the layout
(:func:`orch.launchers.checkpoint.resumed_position`), so at the same global batch no sample is read
twice or skipped. With ``train.elastic.scale_up`` the run returns to its declared plan at the first
checkpoint after the cluster has its devices again.

Each re-plan is printed with its predicted step and ETA, and kept in the MLflow run (a tag each,
``events/replans.json``, the ``replans`` metric); the driver's goodput counts its seconds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from orch.config import RunConfig
from orch.launchers.checkpoint import Published, layout_of, resumable
from orch.launchers.worker_group import GroupNotPlacedError, WorkerDiedError, WorkerGroup
from orch.plans.cluster_facts import worker_slots
from orch.plans.elastic import batch_sizes_to_try, surviving_shape, surviving_shapes
from orch.plans.engines import engine_spec
from orch.plans.spec import ClusterSpec
from orch.run.prepare import PreparedJob, prepare_job, resume_from

if TYPE_CHECKING:
    from orch.launchers.job import TrainJob
    from orch.tracking.store import RunTracker

NODE_DEATH_GRACE_S = 60.0
"""How long, after the plan's devices were not granted, Ray may still count a lost node as alive
(its health checks miss several periods before the node is declared dead) before the run concludes
that no device was lost and fails as a run that could not be placed does."""


SCALE_UP_CHECK_S = 2.0
"""How often a re-planned run asks Ray whether the declared plan's devices are back."""


class ElasticError(WorkerDiedError):
    """The run lost devices and no plan of the survivors can continue it (a failed run: exit 1)."""


@dataclass(frozen=True, kw_only=True)
class Replan:
    """One change of plan: what the run trained on before and after, why, and what it cost."""

    number: int
    why: str
    old_plan: str
    new_plan: str
    old_layout: dict
    new_layout: dict
    """dp, tp, pp, micro-batch, accumulation and engine settings (:func:`orch.launchers.checkpoint.layout_of`)."""
    old_devices: int
    new_devices: int
    old_global_batch: int
    new_global_batch: int
    resumed_from_step: int
    predicted_step_s: float | None
    eta_s: float | None
    seconds: float
    """Waiting for a replacement and searching: the time the re-plan itself took."""

    def message(self) -> str:
        batch = (f"global batch {self.new_global_batch}" if self.new_global_batch == self.old_global_batch
                 else f"global batch {self.old_global_batch} -> {self.new_global_batch}")
        predicted = ""
        if self.predicted_step_s is not None:
            predicted = f"; predicted {self.predicted_step_s:.3g} s/step"
            if self.eta_s is not None:
                predicted += f", ETA {self.eta_s:.3g} s"
        changed = ", ".join(f"{key} {self.old_layout.get(key)} -> {value}" for key, value in self.new_layout.items()
                            if self.old_layout.get(key) != value)
        return (f"re-plan {self.number} ({self.why}): {self.old_devices} -> {self.new_devices} devices "
                f"({changed or 'the same layout'}), {batch}{predicted}; resuming from step "
                f"{self.resumed_from_step} (the re-plan took {self.seconds:.1f} s)")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ElasticRun:
    """What an elastic run keeps between attempts: its declared run, to return to, and its re-plans."""

    cfg: RunConfig
    model_cfg: dict
    cluster: ClusterSpec
    """The cluster the declared plan was checked against."""
    declared: PreparedJob
    replans: list[Replan] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    """Node ids left out of every later plan (``train.elastic.exclude_stragglers``), and why."""
    _pending_exclusion: str | None = None
    _next_check: float = 0.0

    @property
    def spec(self):
        return self.cfg.train.elastic

    def recover(self, current: PreparedJob, job: TrainJob, error: BaseException, published: Published | None, *,
                steps_done: int, tracker: RunTracker | None, out) -> tuple[WorkerGroup | None, PreparedJob, TrainJob]:
        """After ``error`` lost a worker: the group placed again at the current plan if its devices come
        back within ``train.elastic.wait_s`` (returned, to train on), else the run re-planned for the
        survivors, with its job pointed at ``published``, the last checkpoint the restart found (no group
        yet)."""
        started = time.perf_counter()
        world = current.group_spec.world_size
        print(f"elastic: a worker was lost ({type(error).__name__}); waiting up to {self.spec.wait_s:g}s for "
              f"{world} devices", file=out, flush=True)
        try:
            waiting = dataclasses.replace(current.group_spec, wait_s=max(self.spec.wait_s, 0.1))
            return WorkerGroup.create(waiting), current, job
        except GroupNotPlacedError as not_placed:
            shapes = self._survivors(current, not_placed)
        why = f"{world - shapes[0].world_size} of {world} devices lost: {type(error).__name__}"
        return (None, *self._replan(current, job, shapes, why, started, published, steps_done=steps_done,
                                    tracker=tracker, out=out))

    def exclude(self, node_id: str, why: str) -> None:
        """Leave ``node_id`` out from the next plan on (the group stops at its next checkpoint)."""
        self.excluded[node_id] = why
        self._pending_exclusion = why

    def change_plan(self, current: PreparedJob, job: TrainJob, *, steps_done: int, tracker: RunTracker | None,
                    out) -> tuple[WorkerGroup | None, PreparedJob, TrainJob]:
        """After the group stopped at a checkpoint on the driver's request: a re-plan without an
        excluded node, or the declared plan once its devices are back (:meth:`scale_up`)."""
        if self._pending_exclusion is None:
            return self.scale_up(current, job, steps_done=steps_done, tracker=tracker, out=out)
        why, self._pending_exclusion = self._pending_exclusion, None
        started = time.perf_counter()
        shapes = self._shapes()
        return (None, *self._replan(current, job, shapes, f"node left out: {why}", started, self._published(job),
                                    steps_done=steps_done, tracker=tracker, out=out))

    def scale_up_ready(self, current: PreparedJob) -> bool:
        """Whether a re-planned run may go back to its declared plan now: allowed, and the live
        cluster holds the declared plan's devices again (asked of Ray every :data:`SCALE_UP_CHECK_S`)."""
        if not self.spec.scale_up or current.plan == self.declared.plan or time.monotonic() < self._next_check:
            return False
        self._next_check = time.monotonic() + SCALE_UP_CHECK_S
        nodes, per_node = surviving_shape(live_slots(self.cluster, self.excluded), self.cluster)
        return nodes * per_node >= self.declared.group_spec.world_size

    def scale_up(self, current: PreparedJob, job: TrainJob, *, steps_done: int, tracker: RunTracker | None,
                 out) -> tuple[WorkerGroup | None, PreparedJob, TrainJob]:
        """After the group stopped at a checkpoint for :meth:`scale_up_ready`: the declared plan's group
        placed (returned, to train on) and its job pointed at that checkpoint; or, when the devices
        were taken again meanwhile, the current plan resumed there (no group yet)."""
        started = time.perf_counter()
        published = self._published(job)
        try:
            group = WorkerGroup.create(dataclasses.replace(self._excluding(self.declared).group_spec,
                                                           wait_s=max(self.spec.wait_s, 0.1)))
        except GroupNotPlacedError:
            print("elastic: the declared plan's devices were taken again before its workers started; training on "
                  "with the current plan", file=out, flush=True)
            return None, current, resume_from(job, self.cfg, published, out) if published else job
        declared_job = dataclasses.replace(self.declared.job, run_id=job.run_id)
        if published is not None:
            declared_job = resume_from(declared_job, self.cfg, published, out)
        self._record(current, self.declared, f"{self.declared.group_spec.world_size} devices available again",
                     published, started, steps_done=steps_done, tracker=tracker, out=out)
        return group, self._excluding(self.declared), declared_job

    def _survivors(self, current: PreparedJob, not_placed: GroupNotPlacedError) -> list[ClusterSpec]:
        """The clusters left (:meth:`_shapes`), once Ray counts fewer devices than the current plan's: it
        counts a lost node alive until its health checks fail, and this waits for that (at most
        :data:`NODE_DEATH_GRACE_S`). Raises ``not_placed`` when every device is still there (the group
        was not granted for another reason: other jobs hold the devices)."""
        deadline = time.monotonic() + NODE_DEATH_GRACE_S
        while True:
            nodes, per_node = surviving_shape(live_slots(self.cluster, self.excluded), self.cluster)
            if nodes * per_node < current.group_spec.world_size:
                break
            if time.monotonic() > deadline:
                raise not_placed
            time.sleep(1.0)
        return self._shapes()

    def _shapes(self) -> list[ClusterSpec]:
        """The uniform clusters the live nodes hold (:func:`orch.plans.elastic.surviving_shapes`), of
        ``train.elastic.min_devices`` or more, largest first; :class:`ElasticError` when there is none."""
        held = surviving_shapes(live_slots(self.cluster, self.excluded), self.cluster)
        shapes = [dataclasses.replace(self.cluster, nodes=nodes, devices_per_node=per_node)
                  for nodes, per_node in held if nodes * per_node >= self.spec.min_devices]
        if not shapes:
            devices = held[0][0] * held[0][1] if held else 0
            raise ElasticError(f"{devices} device(s) left, fewer than train.elastic.min_devices="
                               f"{self.spec.min_devices}; the run stops at its last checkpoint. Fix: add nodes and "
                               "resume it (train.resume=auto), or lower train.elastic.min_devices")
        return shapes

    def _excluding(self, prepared: PreparedJob) -> PreparedJob:
        """``prepared`` with its workers kept off the excluded nodes."""
        if not self.excluded:
            return prepared
        spec = dataclasses.replace(prepared.group_spec, excluded_nodes=tuple(sorted(self.excluded)))
        return dataclasses.replace(prepared, group_spec=spec)

    def _replan(self, current: PreparedJob, job: TrainJob, shapes: list[ClusterSpec], why: str, started: float,
                published: Published | None, *, steps_done: int, tracker: RunTracker | None,
                out) -> tuple[PreparedJob, TrainJob]:
        cfg = self._search(current, shapes, published)
        replanned = self._excluding(prepare_job(cfg, self.model_cfg, cfg.cluster, workload=current.workload))
        new_job = dataclasses.replace(replanned.job, run_id=job.run_id)
        if published is not None:
            new_job = resume_from(new_job, cfg, published, out)
        self._record(current, replanned, why, published, started, steps_done=steps_done, tracker=tracker, out=out)
        return replanned, new_job

    def _search(self, current: PreparedJob, shapes: list[ClusterSpec], published: Published | None) -> RunConfig:
        """The run's config (its ``cluster`` the shape chosen) at the fastest plan its checkpoint can
        resume on the largest of ``shapes`` that has one, at the closest global batch allowed; raises
        :class:`ElasticError` when there is none."""
        from orch.plans.search.space import plan_spec, search
        from orch.tune.search import prepare

        deadline = time.monotonic() + self.spec.replan_timeout_s
        plan = current.plan
        saved = (published.layout or {}) if published else {}
        rules = engine_spec(plan.engine)
        data = current.workload.data
        reasons = []
        for survivors in shapes:
            base = dataclasses.replace(self.cfg, cluster=survivors)
            space, ctx = prepare(base, self.model_cfg, survivors, current.workload)
            # The checkpoint's engine and settings stay: a resume changes the layout, not the engine.
            space = dataclasses.replace(space, engines=(plan.engine,), zero_stages=(plan.zero_stage,))
            for batch in batch_sizes_to_try(plan.global_batch_size, self.spec.batch_tolerance, survivors.world_size):
                result = search(dataclasses.replace(space, global_batch_size=batch), ctx)
                for candidate in result.ranked:
                    if problem := rules.resume_problem(saved, candidate.plan):
                        reasons.append(problem)
                        continue
                    if list(data.violations(candidate.plan.dp * candidate.plan.micro_batch_size)):
                        reasons.append("the data has too few samples")
                        continue
                    train = dataclasses.replace(self.cfg.train, global_batch_size=batch)
                    return dataclasses.replace(base, plan=plan_spec(candidate.plan), train=train)
                reasons += [f"{reason} ({count})" for reason, count in result.rejected.most_common(3)]
                if time.monotonic() > deadline:
                    break
            if time.monotonic() > deadline:
                reasons.append(f"the search passed train.elastic.replan_timeout_s={self.spec.replan_timeout_s:g}")
                break
        sizes = " or ".join(f"{s.nodes}x{s.devices_per_node}" for s in shapes)
        raise ElasticError(
            f"no plan of the surviving devices ({sizes}: nodes x devices) continues the run at global batch "
            f"{plan.global_batch_size} (train.elastic.batch_tolerance={self.spec.batch_tolerance:g}): "
            f"{'; '.join(dict.fromkeys(reasons)) or 'none fits'}. Fix: raise train.elastic.batch_tolerance, add "
            "nodes and resume (train.resume=auto), or widen the search (tune.*)")

    def _published(self, job: TrainJob) -> Published | None:
        return resumable(self.cfg.train.checkpoint_dir, job.model_signature)

    def _record(self, old: PreparedJob, new: PreparedJob, why: str, published: Published | None, started: float, *,
                steps_done: int, tracker: RunTracker | None, out) -> Replan:
        resumed_from = published.step if published else 0
        step_s = new.predicted_step.total_s if new.predicted_step else None
        left = self.cfg.train.steps - resumed_from
        replan = Replan(number=len(self.replans) + 1, why=why, old_plan=old.plan.layout_text(),
                        new_plan=new.plan.layout_text(), old_layout=layout_of(old.plan),
                        new_layout=layout_of(new.plan), old_devices=old.group_spec.world_size,
                        new_devices=new.group_spec.world_size, old_global_batch=old.plan.global_batch_size,
                        new_global_batch=new.plan.global_batch_size, resumed_from_step=resumed_from,
                        predicted_step_s=step_s, eta_s=step_s * left if step_s is not None else None,
                        seconds=time.perf_counter() - started)
        self.replans.append(replan)
        print(replan.message(), file=out, flush=True)
        if tracker:
            tracker.set_tags({f"replan.{replan.number}": replan.message()})
            tracker.log_dict({"replans": [r.as_dict() for r in self.replans]}, "events/replans.json")
            tracker.log_metrics({"replans": replan.number, "replan/devices": replan.new_devices}, step=steps_done)
        return replan


def live_slots(cluster: ClusterSpec, excluded: dict[str, str] | None = None) -> list[int]:
    """Workers each alive node of the Ray cluster holds, as ``cluster`` sizes a worker, leaving out the
    ``excluded`` node ids."""
    return [worker_slots(cluster, node.get("Resources", {}).get("CPU", 0), node.get("Resources", {}).get("GPU", 0))
            for node in ray.nodes() if node.get("Alive") and node.get("NodeID") not in (excluded or {})]
