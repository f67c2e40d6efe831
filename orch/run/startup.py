"""`orch train`'s start-up: its steps overlapped (:class:`Startup`) and timed phase by phase (:class:`StartupClock`).

A run that takes 20 s to show its first step leaves its user guessing whether the plan check, Ray, the
worker processes or DeepSpeed's initialization is to blame. The driver marks the end of each phase
once; `orch train` prints the split beside the time to the first report, and the MLflow run keeps it
as ``startup/<phase>_s`` metrics, so slow starts can be compared across runs and clusters.

Start-up is mostly imports and process starts, bound by CPU time on a node with few cores per rank.
What shortens it on the driver's side is done by :class:`Startup`, one step at a time, so the
driver reads as check, track, train; the workers' side is :func:`orch.launchers.lean_startup.collector_paused`
and the engines' own lean imports.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import TypeVar

from orch.config import RunConfig
from orch.launchers.lean_startup import collector_paused
from orch.launchers.ray_session import RaySessionHandle
from orch.plans.resolve import ResolvedPlan
from orch.run.early_ray import early_ray, run_ray_session

T = TypeVar("T")

PHASES = {
    "imports": "`orch train`'s driver (torch, DeepSpeed) imported, an embedded Ray starting meanwhile where the "
               "declared values size it",
    "check": "plan check: the live cluster read off Ray when cluster.address is set (connecting to it), "
             "model probe on meta, memory estimate, FLOP count, then the tracking store opened (an embedded Ray "
             "starting and MLflow imported meanwhile)",
    "tracking": "MLflow run created (or resumed), while Ray starts",
    "ray": "the rest of an embedded Ray's start, unless it was ready already",
    "workers": "placement group and one actor process per worker",
    "setup": "DeepSpeed initialization on every worker: process group, model, engine",
    "first_report": "the first train.log_every steps, until their report reached the driver",
}
"""The phases in the order they run, with what each covers."""


@dataclass
class StartupClock:
    """Seconds spent in each start-up phase, each one measured from the end of the one before."""

    started: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    _last: float | None = None

    def mark(self, phase: str) -> None:
        """End ``phase`` now. Only the first time counts: a restart repeats phases, but it is
        not start-up, and once the first report is marked the clock is done."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; known: {', '.join(PHASES)}")
        if phase in self.phases or "first_report" in self.phases:
            return
        now = time.perf_counter()
        self.phases[phase] = now - (self.started if self._last is None else self._last)
        self._last = now

    def metrics(self) -> dict[str, float]:
        return {f"startup/{phase}_s": seconds for phase, seconds in self.phases.items()}


def describe(phases: dict[str, float]) -> str:
    """``check 2.1s, tracking 0.3s, ...`` in the order the phases ran."""
    return ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f}s" for phase, seconds in phases.items())


@contextlib.contextmanager
def in_background(work: Callable[..., T], *args) -> Iterator[Callable[[], T]]:
    """Run ``work(*args)`` in a thread while the block runs; yield ``result()``, which waits for it
    (raising what it raised). Leaving the block waits for it too, so nothing outlives the command."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=getattr(work, "__name__", "work")) \
            as pool:
        yield pool.submit(work, *args).result


TRACKING_MODULE = "orch.tracking.train_run"
"""The module that creates a tracked run: it imports MLflow, which takes seconds."""


@dataclass
class Startup:
    """The driver's start-up of one run, as steps it calls in order; each says what overlaps what.

    0. `orch train` begins with :meth:`for_command`, before torch is imported: an embedded Ray
       starts at once where the declared values size it (:mod:`orch.run.early_ray`), and
       :meth:`driver` imports the driver (torch, DeepSpeed) meanwhile. Library callers (tests,
       `orch tune`'s trials) start at step 1.
    1. ``with Startup(...)``: the garbage collector is paused (:func:`collector_paused`) until
       Ray is ready; the clock started when this object was made.
    2. :meth:`inputs_valid`: the declared values passed, so an embedded Ray starts in the
       background (unless `orch train` started it before importing torch:
       :func:`orch.run.early_ray.early_ray`) and MLflow is imported in another thread,
       while the driver checks the model and the data.
    3. :meth:`tracking_module`: MLflow's import, waited for when the tracking store is opened.
    4. :meth:`checked`: every check passed. Ray is taken without waiting: that puts the program's
       SIGTERM handler back (Ray's core worker replaced it with one that aborts) before the MLflow
       run is created.
    5. :meth:`tracked`: the MLflow run exists (or none is tracked).
    6. :meth:`ray_up`: waits for the rest of Ray's start; start-up's imports are over, so the
       collector runs again (what survived them is frozen).
    7. :meth:`ray_done`, once the workers are gone: an embedded Ray shuts down in the background
       while the driver logs the trained model and the plots.

    The driver marks the workers' phases on :attr:`clock` itself. Leaving the block waits for the
    background import and shuts down a Ray started here; a refusal raised in the block comes without
    waiting for that Ray's start (:func:`orch.launchers.ray_session.ray_session_in_background`).

    Two start-up measures live where their processes start instead: ``orch/__main__.py``
    pauses the collector while the command line's modules are imported, before any config is
    read, and each worker's own start is :mod:`orch.launchers.lean_startup` and its engine's lean imports.
    """

    cfg: RunConfig
    ray_ready: RaySessionHandle | None = None
    """The handle of the run's embedded Ray once one is starting (:meth:`for_command` or
    :meth:`inputs_valid`), or of one a caller started already and shuts down itself."""
    clock: StartupClock = field(default_factory=StartupClock)
    _held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, init=False, repr=False)
    _paused: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, init=False, repr=False)
    _imported: Callable[[], ModuleType] | None = field(default=None, init=False, repr=False)

    @classmethod
    @contextlib.contextmanager
    def for_command(cls, cfg: RunConfig) -> Iterator[Startup]:
        """`orch train`'s start-up, entered before torch is imported: the collector is paused and an
        embedded Ray starts now where the declared values size it (:func:`early_ray`); hand the
        object to :func:`orch.run.driver.run_training`. Ray is shut down when the block ends."""
        with cls(cfg) as startup:
            startup.ray_ready = startup._held.enter_context(early_ray(cfg))
            yield startup

    def driver(self) -> ModuleType:
        """:mod:`orch.run.driver`, imported now (it imports torch and DeepSpeed), with the
        collector paused and Ray starting meanwhile; ends the "imports" phase."""
        module = importlib.import_module("orch.run.driver")
        self.clock.mark("imports")
        return module

    def __enter__(self) -> Startup:
        self._held.enter_context(self._paused)
        self._paused.enter_context(collector_paused())
        return self

    def __exit__(self, *exc_info) -> bool:
        return self._held.__exit__(*exc_info)

    def inputs_valid(self, plan: ResolvedPlan, *, data_cpus: float) -> None:
        """Start what waits only for valid declared values: Ray, sized for ``plan``'s workers and
        ``data_cpus`` more, and MLflow's import."""
        if self.ray_ready is None:
            self.ray_ready = self._held.enter_context(run_ray_session(self.cfg, plan, data_cpus=data_cpus))
        self._imported = self._held.enter_context(in_background(importlib.import_module, TRACKING_MODULE))

    def tracking_module(self) -> ModuleType:
        """:data:`TRACKING_MODULE`, once its background import finished (raising what it raised)."""
        if self._imported is None:
            raise RuntimeError("Startup.tracking_module() called before Startup.inputs_valid()")
        return self._imported()

    def checked(self) -> None:
        """Every check passed: end the "check" phase and take Ray without waiting for it."""
        self.clock.mark("check")
        self._ray(wait=False)

    def tracked(self) -> None:
        """The MLflow run is created or resumed (or the run is not tracked)."""
        self.clock.mark("tracking")

    def ray_up(self) -> None:
        """Wait for Ray's start, end the "ray" phase and run the garbage collector again."""
        self._ray()
        self.clock.mark("ray")
        self._paused.close()

    def ray_done(self) -> None:
        """Nothing more of the run uses Ray: let its session go (an embedded Ray stops in the
        background; a Ray this process did not start is left running)."""
        if self.ray_ready is not None:
            self.ray_ready.release()

    def _ray(self, *, wait: bool = True) -> bool:
        if self.ray_ready is None:
            raise RuntimeError("Startup: Ray is taken before Startup.inputs_valid() started it")
        return self.ray_ready(wait=wait)
