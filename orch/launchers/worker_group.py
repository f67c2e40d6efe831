"""The worker group: create → setup → train → shutdown, one Ray actor per device.

A placement group reserves one bundle per worker before any actor starts, so a run either
gets all its devices or none; a failed start tears down whatever was created.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orch.launchers import worker_pool
from orch.launchers.gpu_sharing import share_gpus
from orch.launchers.job import PollStatus, StepReport, TrainJob, WorkerFacts
from orch.launchers.passthrough import passthrough_env
from orch.launchers.placement import RankSlot, assign_ranks, straddling_groups
from orch.launchers.ray_session import environment_to_ship
from orch.launchers.worker import TrainWorker
from orch.plans.errors import OrchError
from orch.plans.spec import Accelerator, TrainSpec

# How often the driver asks the workers for reports. Every poll wakes each worker's main thread,
# which then competes with its training thread for the GIL and a core: at 0.1 s that thread used
# 1.6% of a core in each worker of a 2-rank run on 2 cores (per-thread CPU from /proc), beside the
# driver's own loop. Half a second is still live for a progress bar and far below any hang timeout.
POLL_INTERVAL_S = 0.5
FIRST_POLL_INTERVAL_S = 0.1
"""Polling until the first report arrives: it ends the start-up the user waits through."""


RESET_TIMEOUT_S = 30.0
"""How long a finished group's actors have to reset themselves for the next run before they are killed."""

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node, holding its node id."""


class WorkerGroupError(OrchError):
    """The worker group could not start or a worker failed."""


class WorkerDiedError(WorkerGroupError):
    """A worker process is gone (killed, out of memory, node lost)."""


class WorkerHangError(WorkerGroupError):
    """Ranks stopped making progress; carries every rank's stack."""

    def __init__(self, ranks: list[int], detail: str, stacks: dict[int, str]):
        self.ranks = ranks
        self.detail = detail
        self.stacks = stacks
        super().__init__(f"rank(s) {', '.join(map(str, ranks))} stopped reporting: {detail}")

    def __reduce__(self):
        return (type(self), (self.ranks, self.detail, self.stacks))


class WorkerFailedError(WorkerGroupError):
    """Training (or its set-up) raised inside one worker; carries that worker's traceback."""

    def __init__(self, rank: int, traceback_text: str, during: str = ""):
        self.rank = rank
        self.traceback_text = traceback_text
        self.during = during
        last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else "unknown error"
        where = f" during {during}" if during else ""
        super().__init__(f"rank {rank} failed{where}: {last}\n{traceback_text}")

    def __reduce__(self):
        return (type(self), (self.rank, self.traceback_text, self.during))


_TERMINAL_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def remote_traceback(error: ray.exceptions.RayTaskError) -> str:
    """The worker's own traceback of ``error`` as plain text, without the colour codes Ray adds
    for a terminal (they garble a log file, a CI log, `--json` output)."""
    return _TERMINAL_ESCAPES.sub("", getattr(error, "traceback_str", None) or str(error))


def _first_failure(calls: list) -> tuple[int, ray.exceptions.RayTaskError] | None:
    """The lowest rank whose finished call raised, and its error."""
    ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
    for call in sorted(ready, key=calls.index):
        try:
            ray.get(call, timeout=0)
        except ray.exceptions.RayTaskError as error:
            return calls.index(call), error
        except ray.exceptions.RayError:
            continue
    return None


@dataclass(frozen=True, kw_only=True)
class WorkerGroupSpec:
    world_size: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    strategy: str = "PACK"
    """Placement group strategy (:func:`orch.launchers.placement.placement_strategy`)."""
    tp: int = 1
    """Tensor-parallel degree: each group of tp consecutive ranks must land on one node."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the worker processes (set before anything is imported there)."""
    wait_s: float = 120.0
    """How long to wait for the cluster to grant the resources."""
    excluded_nodes: tuple[str, ...] = ()
    """Ray node ids no worker may be placed on (an elastic run's straggling nodes)."""

    @property
    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        return bundle


def worker_env(accelerator: Accelerator) -> dict[str, str]:
    """What every worker process of this accelerator needs in its environment, calibration's included."""
    env = {"PYTHONUNBUFFERED": "1", **passthrough_env(os.environ)}
    if accelerator == Accelerator.cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def job_env(accelerator: Accelerator, train: TrainSpec) -> dict[str, str]:
    """Every training worker's environment: :func:`worker_env` and the collectives' timeout."""
    return {**worker_env(accelerator), **collective_timeout_env(train.hang_timeout_s, train.setup_timeout_s)}


def collective_timeout_env(hang_timeout_s: float, setup_timeout_s: float = 0.0) -> dict[str, str]:
    """Worker environment that makes the process group's own timeout outlast the hang detectors.

    A collective that never completes also ends in gloo or NCCL, once the process group's
    timeout passes: DeepSpeed's ``DEEPSPEED_TIMEOUT`` minutes, read when it is imported, 10 by
    default, which is *shorter* than the default ``train.hang_timeout_s`` of 900 s (and
    ``train.setup_timeout_s``, for a rank left waiting in setup's collectives). The rank would
    then fail with a bare timeout and no stacks. Adding DeepSpeed's own 10 minutes on top of the
    longer timeout leaves the detector time to collect every rank's stack first. With hang
    detection off (0) the process group's timeout stays as DeepSpeed sets it: the only guard.
    """
    if not hang_timeout_s:
        return {}
    return {"DEEPSPEED_TIMEOUT": str(math.ceil(max(hang_timeout_s, setup_timeout_s) / 60) + 10)}


def _resource_shortfall(spec: WorkerGroupSpec) -> str:
    available = ray.available_resources()
    needs = ", ".join(f"{v:g} {k}" for k, v in spec.bundle.items())
    free = ", ".join(f"{available.get(k, 0):g} {k}" for k in spec.bundle)
    return f"the plan needs {spec.world_size} workers with {needs} each; the cluster has {free} free"


class NoPlacementError(WorkerGroupError):
    """The cluster did not grant the actors' resources in time."""


class GroupNotPlacedError(WorkerGroupError):
    """The worker group's devices were not granted in time (an elastic run re-plans on this)."""


@dataclass(frozen=True)
class PlacedActors:
    """Actors of one placement group, one per bundle, ordered by the rank :func:`assign_ranks` gives them."""

    pg: object
    actors: list
    slots: list[RankSlot]

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)


def place_actors(actor_class: type, spec: WorkerGroupSpec, *, max_concurrency: int = 1) -> PlacedActors:
    """One ``actor_class`` actor per bundle of a placement group of ``spec``'s shape, with ranks.

    The training workers and the tuner's calibration workers are placed this way, so they land
    the same way. Raises :class:`NoPlacementError` when the cluster does not grant the bundles
    within ``spec.wait_s``; a partial start is torn down.
    """
    # Ray labels every node with its id: a bundle's label selector keeps the excluded ones out
    # (selectors came with Ray 2.49; the argument is given only when a node is excluded).
    worker_pool.release_idle()  # idle workers hold devices these actors may need
    selector = ({"bundle_label_selector": [{NODE_ID_LABEL: f"!in({','.join(spec.excluded_nodes)})"}] * spec.world_size}
                if spec.excluded_nodes else {})
    pg = placement_group([spec.bundle] * spec.world_size, strategy=spec.strategy, **selector)
    actors: list = []
    try:
        if not ray.wait([pg.ready()], timeout=spec.wait_s)[0]:
            raise NoPlacementError(f"no placement within {spec.wait_s:g}s: {_resource_shortfall(spec)}")
        remote_cls = ray.remote(actor_class)
        shipped = environment_to_ship(spec.env)
        for i in range(spec.world_size):
            actors.append(remote_cls.options(
                num_cpus=spec.cpus_per_worker, num_gpus=spec.gpus_per_worker, max_concurrency=max_concurrency,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=i),
                runtime_env={"env_vars": shipped} if shipped else None,
            ).remote())
        slots = assign_ranks(ray.get([a.node_id.remote() for a in actors]))
        order = sorted(range(len(actors)), key=lambda i: slots[i].rank)
        return PlacedActors(pg, [actors[i] for i in order], [slots[i] for i in order])
    except BaseException:
        PlacedActors(pg, actors, []).release()
        raise


def hang_culprits(polls: list[PollStatus]) -> list[int]:
    """The ranks a hang waits for: of those still training, the ones with the fewest milestones.

    Every unfinished rank is a candidate, not only those already past the timeout: ranks leave
    their last step together, so the one that waits in a collective can cross the timeout a
    poll before the one it waits for.
    """
    training = [r for r, poll in enumerate(polls) if not poll.done]
    behind = min(polls[r].milestones for r in training)
    return [r for r in training if polls[r].milestones == behind]


class WorkerGroup:
    """A running set of :class:`TrainWorker` actors with ranks assigned."""

    def __init__(self, spec: WorkerGroupSpec, pg, actors: list, slots: list[RankSlot]):
        self.spec = spec
        self._pg = pg
        self.actors = actors
        self.slots = slots
        self.facts: list[WorkerFacts] = []
        self.finished = False
        """Every rank finished its training and reported it (:meth:`train` ended normally)."""

    @classmethod
    def create(cls, spec: WorkerGroupSpec) -> WorkerGroup:
        """The group's actors: the pool's idle ones when a run of the same shape left them
        (:mod:`orch.launchers.worker_pool`), new ones otherwise."""
        kept = worker_pool.take(TrainWorker, _pooled_shape(spec))
        if kept is not None:
            placed, slots = kept, kept.slots
        else:
            try:
                placed = place_actors(TrainWorker, spec, max_concurrency=2)  # stacks() answers during a hung setup()
            except NoPlacementError as error:
                raise GroupNotPlacedError(f"{error}. Fix: lower cluster.devices_per_node/cluster.nodes or add nodes.") \
                    from None
        try:
            straddling = straddling_groups(placed.slots, spec.tp)
            if straddling:
                raise WorkerGroupError(
                    f"Ray placed tensor-parallel group(s) {straddling} across nodes (tp={spec.tp}): the "
                    "cluster's free devices are spread unevenly over its nodes. Fix: free whole nodes, "
                    "or set plan.tp to a divisor of the free devices of every node")
            if kept is None:
                slots = share_gpus(placed.actors, placed.slots) if spec.gpus_per_worker else placed.slots
            return cls(spec, placed.pg, placed.actors, slots)
        except BaseException:
            placed.release()
            raise

    def setup(self, job: TrainJob, *, timeout_s: float = 0.0,
              streams: list[tuple[Any, Any]] | None = None) -> list[WorkerFacts]:
        """Rendezvous on rank 0's node and build the DeepSpeed engine on every rank.

        ``streams`` holds one ``(training, evaluation)`` pair per data-parallel replica of a
        streamed data source; each goes to its replica's first rank (tp and pp rank 0).

        Ranks still setting up after ``timeout_s`` (0: no limit) raise :class:`WorkerHangError`
        with every rank's stack: a stuck rendezvous, a JIT build waiting on a stale lock or a
        model that never finishes building would otherwise hold the run (or a tuning trial)
        forever. (A rank that raises fails the setup at once: ``ray.get`` of all the calls
        raises the first error without waiting for the peers, which wait for that rank.)
        """
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        world_size = len(self.actors)
        plan = job.plan
        first_rank_streams = {replica * plan.pp * plan.tp: pair for replica, pair in enumerate(streams or [])}
        calls = [actor.setup.remote(job, slot, world_size, master_addr, master_port,
                                    first_rank_streams.get(slot.rank))
                 for actor, slot in zip(self.actors, self.slots, strict=True)]
        try:
            self.facts = ray.get(calls, timeout=timeout_s or None)
        except ray.exceptions.GetTimeoutError:
            _, pending = ray.wait(calls, num_returns=len(calls), timeout=0)
            raise WorkerHangError([calls.index(call) for call in pending],
                                  f"setup (process group, model, DeepSpeed engine) unfinished after {timeout_s:g}s; "
                                  "train.setup_timeout_s sets the limit", self._stacks()) from None
        except ray.exceptions.RayTaskError as error:
            rank, error = _first_failure(calls) or (-1, error)
            # An error a worker raises on purpose (a checkpoint the safe loader refused) is a
            # message for the user, which Ray's wrapper would bury under a remote traceback.
            if isinstance(error.cause, OrchError):
                raise error.cause from None
            # Any other: which rank, in which phase, and the worker's own traceback (the file and
            # line that raised), not Ray's coloured wrapper of it.
            raise WorkerFailedError(rank, remote_traceback(error), during="setup") from None
        self.facts = [dataclasses.replace(fact, node_id=slot.node_id)
                      for fact, slot in zip(self.facts, self.slots, strict=True)]
        return self.facts

    def train(self, *, hang_timeout_s: float = 0.0, poll_interval_s: float | None = None,
              on_system: Callable[[int, list[dict], int], None] | None = None) -> Iterator[list[StepReport]]:
        """Yield, per logged step, the reports of all ranks (ordered by rank).

        ``on_system(rank, samples, step)`` receives the hardware samples of the node a rank samples
        (:mod:`orch.launchers.system_metrics`) as they arrive, with the last optimizer step that rank finished.

        Polls every worker; a worker whose training raised fails the run with its traceback,
        and a dead worker raises Ray's ActorDiedError at once, instead of the other ranks
        waiting in a collective forever. A rank that finishes no step for ``hang_timeout_s``
        raises :class:`WorkerHangError` with every rank's stack.
        """
        ray.get([actor.start.remote() for actor in self.actors])
        seen = [0] * len(self.actors)
        by_step: dict[int, dict[int, StepReport]] = {}
        while True:
            polls = ray.get([actor.poll.remote(n) for actor, n in zip(self.actors, seen, strict=True)])
            for rank, poll in enumerate(polls):
                if poll.error:
                    raise WorkerFailedError(rank, poll.error)
                seen[rank] += len(poll.reports)
                if on_system is not None and poll.system:
                    on_system(rank, poll.system, poll.step)
                for report in poll.reports:
                    by_step.setdefault(report.step, {})[rank] = report
            for step in sorted(by_step):
                if len(by_step[step]) < len(self.actors):
                    break
                reports = by_step.pop(step)
                yield [reports[r] for r in sorted(reports)]
            if all(poll.done for poll in polls) and not by_step:
                self.finished = True
                return
            stalled = [r for r, poll in enumerate(polls)
                       if not poll.done and hang_timeout_s and poll.since_progress_s > hang_timeout_s]
            if stalled:
                raise self._hang_error(polls, hang_timeout_s)
            time.sleep(poll_interval_s if poll_interval_s is not None
                       else POLL_INTERVAL_S if any(seen) else FIRST_POLL_INTERVAL_S)

    def _hang_error(self, polls: list[PollStatus], timeout_s: float) -> WorkerHangError:
        steps = ", ".join(f"rank {r}: step {p.step}" for r, p in enumerate(polls))
        return WorkerHangError(hang_culprits(polls), f"no optimizer step for {timeout_s:g}s ({steps})", self._stacks())

    def _stacks(self) -> dict[int, str]:
        """Every rank's Python stacks, asked while the rank is stuck (the actors take a second call)."""
        stacks = {}
        for rank, actor in enumerate(self.actors):
            try:
                stacks[rank] = ray.get(actor.stacks.remote(), timeout=10)
            except Exception as exc:  # a rank too broken to answer is itself worth reporting
                stacks[rank] = f"<no stack: {type(exc).__name__}: {exc}>"
        return stacks

    def stop_at_next_checkpoint(self) -> None:
        """Ask every rank to stop after the next checkpoint (:meth:`TrainWorker.stop_at_next_checkpoint`);
        :meth:`train` then ends after that checkpoint's report."""
        ray.get([actor.stop_at_next_checkpoint.remote() for actor in self.actors], timeout=30)

    def consolidated_state(self, timeout_s: float = 600.0) -> dict | None:
        """The trained weights gathered whole on rank 0 (every rank takes part in ZeRO-3's gather)."""
        states = ray.get([actor.consolidated_state.remote() for actor in self.actors], timeout=timeout_s)
        return states[0]

    def shutdown(self) -> None:
        """Stop every actor and release the placement group; safe to call twice. Within
        :func:`orch.launchers.worker_pool.reusing_workers`, a group that finished its training
        resets its actors and leaves them to the next group of its shape instead."""
        if self._pg is None:
            return
        if self.finished and worker_pool.pooling() and self._reset():
            worker_pool.keep(TrainWorker, _pooled_shape(self.spec), PlacedActors(self._pg, self.actors, self.slots))
            self._pg = None
            return
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
        except Exception:  # a dead or hung worker cannot shut down cleanly; it is killed below
            pass
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self._pg)
        self._pg = None

    def _reset(self) -> bool:
        """Whether every actor left its run behind (:meth:`TrainWorker.reset`) in time."""
        try:
            return all(ray.get([a.reset.remote() for a in self.actors], timeout=RESET_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a worker that cannot reset is killed, as any other
            return False


def _pooled_shape(spec: WorkerGroupSpec) -> WorkerGroupSpec:
    """What decides whether a group's actors can serve another group: everything but the tp degree
    (checked against the actors' slots each time) and the placement wait."""
    return dataclasses.replace(spec, tp=1, wait_s=0.0)
