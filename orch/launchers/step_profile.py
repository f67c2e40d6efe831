"""One training step under torch's profiler: where its time went, by kind of work, and its trace.

The phase timers (:mod:`orch.launchers.step_phases`) say how long the forward, the backward and
the optimizer step took; they cannot say which of a phase's kernels did: whether a slow backward
is its matmuls, its element-wise work or its collectives, which are the cost model's separate
terms (compute, memory-bound kernels, communication, optimizer, offload copies). A step named in
``train.profile_steps`` runs under :class:`torch.profiler.profile` instead, as torchtitan's
``profiling`` and Accelerate's ``ProfileKwargs`` do, and its work is summed by kind:

- on a GPU, the kernels' device time, each kernel counted under the operator that launched it;
- on a CPU, the operators' own (self) CPU time.

Operators are sorted by the step's phase and by name; on a CPU, the own time of framework
records that are not operators (FSDP's hooks, autograd's bookkeeping, DTensor's dispatch) is
*host* time, the Python between operators. The engine names each phase as it ends
(its milestones); in a profiled step each phase is also a record range (``orch.phase#<i>``), so
every operator knows its phase: whatever runs in the optimizer step's phase (the update, gradient
clipping, an offloaded optimizer's copies) is the optimizer's, as is whatever runs inside torch's
``Optimizer.step`` and ``Optimizer.zero_grad`` records (every ``torch.optim.Optimizer`` subclass,
DeepSpeed's FusedAdam and CPU Adam among them) wherever it falls. The rest is sorted by name
(matmul, attention, communication, copies), and what is left is element-wise and other
memory-bound work. The trace itself (Chrome's JSON format, gzipped) goes to the run for Perfetto
or ``chrome://tracing``, its phases marked.

The profiler slows the step it records, so that step is left out of the reported step time and
of the phase timing.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

KINDS = ("matmul", "attention", "element-wise and other", "communication", "copies", "optimizer", "host")
"""The kinds of work a profiled step's time is summed by, in the order they are shown."""

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::addmv",
                      "aten::mv", "aten::dot", "aten::_int_mm", "aten::addbmm", "aten::_addmm_activation"})
_COPIES = frozenset({"aten::copy_", "aten::_to_copy", "aten::fill_", "aten::zero_", "aten::_pin_memory"})
_OPTIMIZER_RECORDS = ("Optimizer.step#", "Optimizer.zero_grad#")
_OPERATORS = ("aten::", "prims::", "c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")
"""Names of operators (work) rather than of framework records (FSDP's ``FSDP::pre_forward``,
autograd's ``evaluate_function``, DTensor's ``PythonSubclass``), whose own CPU time is Python."""
_COLLECTIVE_RECORDS = ("FSDP::all_gather", "FSDP::post_backward_reduce")
"""FSDP2's records around a unit's all-gather and its gradients' reduce-scatter. On CPU workers
their own time is mostly the wait for the collective, which gloo runs on threads of its own (its
``gloo:*`` events overlap the record), so it is communication, not the record's Python."""


@dataclass(frozen=True)
class StepProfile:
    """One rank's profile of one step (:func:`profiled_step`)."""

    step: int
    wall_s: float
    """The step's wall-clock time under the profiler (slower than unprofiled)."""
    clock: str
    """What ``seconds`` counts: ``"device"`` (kernel time on the GPU) or ``"cpu"`` (operators' own CPU time)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Time by kind of work (:data:`KINDS`)."""
    trace_gz: bytes = b""
    """The step's trace in Chrome's JSON format, gzipped."""

    @property
    def busy_s(self) -> float:
        return sum(self.seconds.values())


PHASE_RANGE = "orch.phase#"
"""The record range of a profiled step's ``i``-th phase: ``orch.phase#<i>`` (:class:`PhaseRanges`)."""


def _is_collective_record(name: str) -> bool:
    """Whether ``name`` is one of FSDP2's collective records (:data:`_COLLECTIVE_RECORDS`)."""
    return any(name == record or name.startswith(f"{record} (") for record in _COLLECTIVE_RECORDS)


def kind_of(name: str, enclosing: list[str], phase: str = "", *, device: bool = False) -> str:
    """The kind of work (:data:`KINDS`) of an operator named ``name`` inside the records ``enclosing``
    (innermost first), in the step's phase ``phase``, its time counted on the device or not."""
    if phase == "optimizer" or any(outer.startswith(_OPTIMIZER_RECORDS) for outer in [name, *enclosing]):
        return "optimizer"
    lowered = name.lower()
    if "c10d" in lowered or "nccl" in lowered or "gloo" in lowered or lowered == "record_param_comms":
        return "communication"
    if name in _MATMULS:
        return "matmul"
    if name.startswith("aten::") and ("attention" in lowered or "flash" in lowered):
        return "attention"
    if name in _COPIES or lowered.startswith("memcpy") or lowered.startswith("memset"):
        return "copies"
    if not device and _is_collective_record(name):
        return "communication"
    if not device and not name.startswith(_OPERATORS):
        # A framework record's own CPU time is its Python (hooks, DTensor dispatch, autograd's
        # bookkeeping); on a device, what a record launches itself is kernels (compiled, extensions).
        return "host"
    return "element-wise and other"


def phase_of(enclosing: list[str], phases: list[str]) -> str:
    """The phase an operator ran in, from the innermost phase range around it (:class:`PhaseRanges`);
    ``""`` outside them."""
    for outer in enclosing:
        if outer.startswith(PHASE_RANGE):
            index = int(outer[len(PHASE_RANGE):])
            return phases[index] if index < len(phases) else "other"
    return ""


def _interval(event: Any) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def _gloo_waits(events: list[Any], phases: list[str]) -> list[tuple[Any, str]]:
    """(event, phase) of each collective gloo ran on a thread of its own outside FSDP2's collective
    records. Such an event is asynchronous, with no own time: the calling thread waits for it in
    whatever record is around the call (a phase range, whose own time no kind holds, under
    DeepSpeed), so its duration is the wait. Under FSDP2's records the records count it already."""
    ranges = [(event, _interval(event)) for event in events if event.name.startswith(PHASE_RANGE)]
    fsdp = [_interval(event) for event in events if _is_collective_record(event.name)]
    waits = []
    for event in events:
        if not (event.name.startswith("gloo:") and getattr(event, "is_async", False)):
            continue
        start, _ = _interval(event)
        if any(low <= start <= high for low, high in fsdp):
            continue
        around = [r for r, (low, high) in ranges if low <= start <= high]
        phase = phase_of([max(around, key=lambda r: r.time_range.start).name], phases) if around else ""
        waits.append((event, phase))
    return waits


def time_by_kind(events: list[Any], *, device: bool, phases: list[str] = ()) -> dict[str, float]:
    """Seconds of ``events`` (torch's ``FunctionEvent``s of one profile) by kind of work: their own
    device time when ``device`` (kernels under the operator that launched them), else their own CPU
    time, and the duration of gloo's collectives (:func:`_gloo_waits`). ``phases`` names the step's
    phase ranges in order."""
    totals = dict.fromkeys(KINDS, 0.0)
    if not device:
        for event, phase in _gloo_waits(events, list(phases)):
            totals[kind_of(event.name, [], phase)] += (event.time_range.end - event.time_range.start) / 1e6
    for event in events:
        if getattr(event, "device_type", None) is not None and str(event.device_type) != "DeviceType.CPU":
            continue  # a kernel itself: counted under the CPU operator that launched it
        micros = event.self_device_time_total if device else event.self_cpu_time_total
        if micros <= 0 or event.name.startswith(PHASE_RANGE):
            continue  # a phase range's own time is the Python between operators, no kind of work
        enclosing, parent = [], event.cpu_parent
        while parent is not None:
            enclosing.append(parent.name)
            parent = parent.cpu_parent
        totals[kind_of(event.name, enclosing, phase_of(enclosing, list(phases)), device=device)] += micros / 1e6
    return {kind: seconds for kind, seconds in totals.items() if seconds > 0}


class PhaseRanges:
    """Each phase of a profiled step as a record range, ``orch.phase#<i>``, opened at the step's start
    and at each milestone, closed at the next: the profile's operators then know their phase."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self._range: Any = None
        self._open()

    def _open(self) -> None:
        from torch.profiler import record_function

        self._range = record_function(f"{PHASE_RANGE}{len(self.phases)}")
        self._range.__enter__()

    def milestone(self, phase: str = "") -> None:
        """The phase ``phase`` ended (the engine's milestone); the next one starts."""
        self._range.__exit__(None, None, None)
        self.phases.append(phase or "other")
        self._open()

    def close(self) -> None:
        self._range.__exit__(None, None, None)


class ProfiledStep:
    """What :func:`profiled_step` yields: the milestone to give the engine, and the profile once done."""

    def __init__(self, milestone: Callable[[str], None]) -> None:
        self._milestone = milestone
        self.ranges = PhaseRanges()
        self.profiles: list[StepProfile] = []

    def milestone(self, phase: str = "") -> None:
        self._milestone(phase)
        self.ranges.milestone(phase)


def prepare_profiler() -> None:
    """Start torch's profiler library on the calling (the worker's main) thread, once, quietly.

    Kineto registers itself on the thread that imported torch and prints an error ("External
    init callback must run in same thread") to the process's stderr when a profiler first starts
    on another one, as a Ray actor's method and training threads are, although profiling works;
    this first, empty start is made with that stream pointed away. It also logs each start and
    stop: ``KINETO_LOG_LEVEL`` (read at its first use) keeps it quiet unless the user set a level.
    """
    import sys

    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]):
                pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def profiled_step(step: int, device: Any, milestone: Callable[[str], None]) -> Iterator[ProfiledStep]:
    """Profile the step run inside, whose engine calls the yielded object's ``milestone`` (which
    calls ``milestone``); its :class:`StepProfile` is in the object's ``profiles`` at the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = getattr(device, "type", "cpu") == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        profiled = ProfiledStep(milestone)
        try:
            yield profiled
        finally:
            profiled.ranges.close()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    seconds = time_by_kind(list(prof.events()), device=on_cuda, phases=profiled.ranges.phases)
    profiled.profiles.append(StepProfile(step=step, wall_s=wall, clock="device" if on_cuda else "cpu",
                                         seconds=seconds, trace_gz=_trace_gz(prof)))


def _trace_gz(prof: Any) -> bytes:
    """The profile's Chrome trace, gzipped (torch writes it to a file only)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as trace:
            return gzip.compress(trace.read(), compresslevel=6)
    finally:
        os.unlink(path)


def summary(profile: StepProfile) -> str:
    """One line: the step's time by kind of work."""
    what = "kernel time" if profile.clock == "device" else "operator CPU time"
    parts = ", ".join(f"{kind} {profile.seconds[kind]:.3f} s" for kind in KINDS if kind in profile.seconds)
    return f"step {profile.step} profiled ({what} {profile.busy_s:.3f} s of {profile.wall_s:.3f} s wall): {parts}"
