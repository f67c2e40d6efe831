"""Measure a worker's real tensor memory on CPU, where no allocator keeps statistics.

``torch.cuda.max_memory_allocated`` has no CPU counterpart: the CPU allocator is plain
``malloc``/``mmap`` and counts nothing. The process RSS is no substitute either, because it also
holds the interpreter, Ray, gloo's buffers and pages glibc has not returned yet. What the planner
predicts is bytes of *tensors*, so this module counts exactly those, from two torch primitives:

* :func:`live_tensor_bytes` scans the garbage collector's objects for tensors and adds up their
  distinct storages: what the process holds at one moment (after a step: the model states).
* :class:`PeakMemoryTracker` watches every operator call while it is active (a
  ``TorchDispatchMode``) and a ``weakref.finalize`` on every storage it knows, so it keeps a
  running total of tensor bytes and remembers its maximum: the peak of one step.

Both run only in the step the worker probes (``train.memory_probe_step``); a dispatch mode costs
a few microseconds of Python per operator, and the scan walks every object of the process.

With ``train.memory_probe_detail`` the tracker also says what was alive at the peak
(:meth:`PeakMemoryTracker.at_peak`): each storage it counts is named when first seen (parameters,
gradients and the other tensors held when the step began; then the operator that made it and the
module whose forward was running, :class:`_ForwardModules`), and the storages alive at the peak
are found again by replaying the log of additions and frees up to it.

An operator on DTensors runs DTensor's own dispatch below the mode, which sees what the operator
returns but not the temporaries made and freed inside. The ones made in DTensor's Python op
handlers (torch's ``loss_parallel`` computes its cross-entropy there: two tensors of the local
logits' size at the loss's peak) are seen: the tracker runs those handlers with itself pushed
again (:meth:`PeakMemoryTracker._watch_handlers`), and bench/results/split_loss_memory.md finds
its count of that loss equal to the resident set's. Still unseen are a redistribution's buffers
inside the C++ dispatch; the sequence- and context-parallel peaks measured through it match the
planner's count within 0-9% (bench/results/memory_accuracy_sequence.md, _context.md).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_of(obj) -> torch.UntypedStorage | None:
    """The storage behind a tensor, or None for tensors that own no countable memory.

    Meta tensors have sizes but no memory. A DTensor's memory is its local shard's. Sparse,
    nested and other wrapper-subclass tensors have no single untyped storage (``untyped_storage()``
    raises, or returns one that is invalid to read); they are not counted (a blind spot that the
    dense models trained here never hit).
    """
    if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
        return None
    local = getattr(obj, "_local_tensor", None)  # a DTensor (FSDP2's shards): its local shard's memory
    if isinstance(local, torch.Tensor):
        obj = local
    try:
        storage = obj.untyped_storage()
        storage.data_ptr()  # a wrapper subclass's storage can exist but be invalid to read
        return storage
    except (RuntimeError, NotImplementedError):
        return None


# How long the scan may hold the interpreter before another thread may ask for it back: a scan of
# a large heap on a loaded 2-core machine took over a second (a test thread building tuples broke).
_HELD_S = 5.0


@contextlib.contextmanager
def _other_threads_held() -> Iterator[None]:
    """Keep the interpreter from other Python threads while the block runs (it must be short,
    under :data:`_HELD_S`, and must not block).

    ``gc.get_objects()`` also lists objects another thread is still building: a tuple made from a
    generator is built in place and resized as it grows, which CPython allows only while nothing
    else refers to it. Another thread that resumed while the list is alive would fail in its
    resize with ``SystemError: bad argument to internal function`` (a worker's system-metrics
    thread importing MLflow did). A thread asks for the interpreter back once it has waited a
    switch interval, so the interval is raised first and the threads that were already waiting
    (under the old one) are given their turn before the block.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(_HELD_S)
    try:
        time.sleep(0.05)
        yield
    finally:
        sys.setswitchinterval(interval)


def _tracked_tensors(*, frozen_too: bool = True) -> list[torch.Tensor]:
    """Every tensor among the objects the garbage collector tracks, and the ``.grad`` of every leaf
    among them (:func:`_with_grads`).

    ``gc.get_objects()`` leaves out objects moved to the permanent generation by ``gc.freeze()``,
    which the workers call after start-up (:func:`orch.launchers.lean_startup.collector_paused`): the
    model and the engine would be missing. With ``frozen_too`` they are unfrozen for the scan and
    frozen again after, with whatever else is alive by then. The list of every object lives only
    while no other thread runs (:func:`_other_threads_held`), and is filtered in C (no bytecode
    runs, so no thread switch is due); what is returned holds tensors only.
    """
    with _other_threads_held():
        thawed = frozen_too and gc.get_freeze_count() > 0
        if thawed:
            gc.unfreeze()
        try:
            objects = gc.get_objects()
        finally:
            if thawed:
                gc.freeze()
        # ``type()`` rather than ``isinstance``: isinstance also asks an object's ``__class__``,
        # which some module-level proxies answer in Python, with a deprecation warning.
        tensors = list(itertools.compress(objects, map(torch.Tensor.__subclasscheck__, map(type, objects))))
        del objects
    return _with_grads(tensors)


def _with_grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, and the ``.grad`` of every leaf among them.

    A gradient autograd wrote from C++ has no Python object until someone reads ``.grad``, so
    ``gc.get_objects()`` alone would miss the gradients of a plain ``torch.optim`` loop. Leaves
    include tensors that do not require grad, which is what DeepSpeed hangs its flat fp32
    gradients on. ``.grad`` is not read on non-leaf tensors: it warns there and is always None.
    """
    return [*tensors, *(t.grad for t in tensors if t.is_leaf and t.grad is not None)]


def _live_storages(tensors: list) -> dict[tuple[str, int], torch.UntypedStorage]:
    """The distinct storages of ``tensors``, keyed by device and address.

    Keyed by address rather than by storage object because two storage objects can wrap the same
    memory (``torch.from_numpy`` twice on one array); views and DeepSpeed's flat buffers with
    parameters narrowed out of them already share one storage object. Empty storages (address 0)
    own no bytes and are skipped.
    """
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = _storage_of(tensor)
        if storage is not None and storage.data_ptr():
            storages.setdefault((storage.device.type, storage.data_ptr()), storage)
    return storages


def live_tensor_bytes() -> int:
    """Bytes of all distinct tensor storages alive in this process: what the engine holds.

    Tensors only C++ references (autograd's saved tensors between forward and backward, a C++
    extension's private buffers) are invisible to this scan; after an optimizer step no autograd
    graph is left, so for the model states this is complete. Garbage in reference cycles that
    ``gc`` has not collected yet is counted, since its memory is still allocated.
    """
    return sum(s.nbytes() for s in _live_storages(_tracked_tensors()).values())


class TensorsMade:
    """Bytes of the tensors made inside the block and still alive at its end (the in-memory
    tensors of a data source), counted without scanning the whole process.

    Entering freezes every object the collector tracks (``gc.freeze``), so at the end
    ``gc.get_objects()`` lists only the objects made since. A tensor made in the block as a view
    of older memory would be counted with that memory.
    """

    def __init__(self):
        self.bytes = 0

    def __enter__(self) -> TensorsMade:
        gc.freeze()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.bytes = sum(s.nbytes() for s in _live_storages(_tracked_tensors(frozen_too=False)).values())


@dataclass(frozen=True)
class HeldAtPeak:
    """Tensor memory alive at the measured peak that one thing made: ``what`` is ``parameters``,
    ``gradients``, ``other tensors held when the step began`` (optimizer states, an engine's flat
    buffers, batches), ``forward: <operator> in <module>`` (``no grad: ...`` where grad mode was
    off, as in a ZeRO-3 gather), or ``no grad (backward, optimizer): <operator>`` and ``outside
    modules: <operator>`` for what no module's forward made."""

    what: str
    bytes: int
    storages: int


HELD_KINDS = ("parameters", "gradients", "other tensors held when the step began")


def _held_kinds(tensors: list[torch.Tensor]) -> dict[int, str]:
    """What each storage alive at the start holds, by storage address: a parameter's, a leaf's
    gradient's, or something else's (the first of these that claims it)."""
    grads = {id(t.grad) for t in tensors if t.is_leaf and t.grad is not None}
    kinds: dict[int, str] = {}
    for tensor in tensors:
        storage = _storage_of(tensor)
        if storage is None or not storage.data_ptr():
            continue
        kind = (HELD_KINDS[0] if isinstance(tensor, torch.nn.Parameter) else
                HELD_KINDS[1] if id(tensor) in grads else HELD_KINDS[2])
        address = storage.data_ptr()
        if address not in kinds or HELD_KINDS.index(kind) < HELD_KINDS.index(kinds[address]):
            kinds[address] = kind
    return kinds


class _ForwardModules:
    """The modules whose forward is running, innermost last, each named by its path from the
    outermost module that ran (``GPT.blocks.3.mlp``), through torch's global forward hooks
    (``register_module_forward_pre_hook``, ``register_module_forward_hook``).

    Nothing hooks tensors or gradients, so nothing the step would free is kept alive: hooks that
    wait for all of a module's gradients (torch's ``ModuleTracker`` puts them on every module's
    inputs and outputs) hold the gradients until the last arrives, and under recomputation some
    never do (a ZeRO-3 run with checkpointing peaked 35% higher with them). Backward therefore
    runs outside any module here; a recomputed layer's forward is named as forward."""

    def __init__(self):
        self.running: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list = []

    def __enter__(self) -> _ForwardModules:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._entered), register_module_forward_hook(self._left)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.running.clear()

    def _name(self, module: torch.nn.Module) -> str:
        name = self._names.get(module)
        if name is None:  # an outermost module: it and everything under it named from it
            name = type(module).__name__
            for path, sub in module.named_modules(prefix=name):
                self._names.setdefault(sub, path)
        return name

    def _entered(self, module: torch.nn.Module, _inputs) -> None:
        self.running.append(self._name(module))

    def _left(self, module: torch.nn.Module, _inputs, _output) -> None:
        name = self._name(module)
        if name in self.running:  # a forward that raised never left: drop what it left behind
            del self.running[len(self.running) - 1 - self.running[::-1].index(name):]


@dataclass
class _Tracked:
    """What the tracker last saw of one storage; ``nbytes`` changes when the storage is resized."""

    nbytes: int
    data_ptr: int
    finalizer: weakref.finalize


class PeakMemoryTracker(TorchDispatchMode):
    """The peak of the process's tensor bytes while the ``with`` block runs.

    On entry the baseline is :func:`live_tensor_bytes`, and every baseline storage gets a
    finalizer. After every operator the storages of its inputs and outputs are looked at: one not
    seen before is added to the running total (and gets a finalizer); one seen before but now of
    a different size (``resize_``, ZeRO-3's ``set_``) changes the total by the difference. A
    finalizer fires when the storage is freed and takes its bytes off the total, which is how
    ``param.data = torch.empty(0)`` (ZeRO-3 releasing a gathered parameter) and activations
    released in backward come off. ``UntypedStorage.resize_`` is no operator: FSDP2 frees a
    gathered block's parameters by resizing their storages to 0 and gathers them again by
    resizing them back, so while the block runs the method is wrapped to count the new size at
    once. :attr:`peak` is the largest total after any operator or resize.

    It sees: forward, autograd's backward (on CPU the engine runs the ops on the calling thread,
    and it carries the dispatch mode to its threads anyway), recomputation of checkpointed
    layers, ``torch.optim`` steps, collectives (c10d ops are dispatcher ops) and tensors made
    outside the dispatcher (``torch.from_numpy``, C++ extensions) as soon as an operator uses
    them. DeepSpeed's CPU Adam updates its tensors in place, so it changes nothing to count.

    Blind spots:

    * memory a kernel allocates and frees inside one operator (scratch buffers, the per-thread
      workspaces of oneDNN and flash attention): never a tensor that an operator returns;
    * operators run on other threads, which do not carry the mode;
    * a storage that existed on entry but only C++ held (so the baseline scan missed it) counts
      from the first operator that uses it, not from the start.
    """

    def __init__(self, *, detail: bool = False):
        super().__init__()
        self.detail = detail
        """Also log what made each storage, for :meth:`at_peak` (``train.memory_probe_detail``)."""
        self._events: list[tuple[int, int, str]] = []  # (storage key, bytes added or freed, what made it)
        self._peak_at = 0  # how many of the events make up the peak
        self._label = HELD_KINDS[2]  # what makes the storages seen now
        self._modules: _ForwardModules | None = None  # while the block runs, with ``detail``
        self._tracked: dict[int, _Tracked] = {}
        self._by_address: dict[int, int] = {}
        self._handlers: dict | None = None  # DTensor's Python op handlers, once DTensor is in use
        self._wrapped: dict = {}  # op -> (its handler, the tracked wrapper put in its place)
        self.baseline = 0
        self.current = 0
        self.peak = 0

    def __enter__(self):
        self._tracked.clear()
        self._by_address.clear()
        self._events.clear()
        self.current = 0
        tensors = _tracked_tensors()
        kinds = _held_kinds(tensors) if self.detail else {}
        for address, storage in _live_storages(tensors).items():
            self._label = kinds.get(address[1], HELD_KINDS[2])
            self._see(storage)
        del tensors
        self.baseline = self.peak = self.current
        self._peak_at = len(self._events)
        if self.detail:
            self._modules = _ForwardModules().__enter__()
        self._own_resize = vars(torch.UntypedStorage).get("resize_")  # None: inherited from the C base
        resize = torch.UntypedStorage.resize_

        def resized(storage: torch.UntypedStorage, size: int):
            out = resize(storage, size)
            if self.detail:
                self._label = self._made_by("resize_")
            self._see(storage)
            return out

        torch.UntypedStorage.resize_ = resized
        if "torch.distributed.tensor" in sys.modules:  # a process that never made a DTensor skips this
            from torch.distributed.tensor import DTensor

            self._handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._modules is not None:
                self._modules.__exit__(None, None, None)
                self._modules = None
            if self._own_resize is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._own_resize
            for op, (handler, tracked) in self._wrapped.items():
                if self._handlers.get(op) is tracked:
                    self._handlers[op] = handler
            self._wrapped.clear()
            # Finalizers left registered would keep this tracker alive and keep counting after the
            # step; the numbers are final once the block ends.
            for tracked in self._tracked.values():
                tracked.finalizer.detach()
            self._tracked.clear()
            self._by_address.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._handlers is not None and any(kind is not torch.Tensor for kind in types):
            self._watch_handlers()
        out = func(*args, **kwargs)
        if self.detail:
            self._label = self._made_by(str(func.overloadpacket))
        # Inputs too: an in-place op or an op on a tensor made outside the dispatcher returns no
        # new storage, but its input may be one the tracker has not met yet.
        for leaf in tree_flatten((args, kwargs, out))[0]:
            storage = _storage_of(leaf)
            if storage is not None:
                self._see(storage)
        return out

    def _watch_handlers(self) -> None:
        """Run DTensor's Python op handlers with the tracker active (pushed again: the dispatcher
        pops a mode while its own handler runs, and DTensor's dispatch runs below it).

        Those handlers (torch's ``loss_parallel`` registers its cross-entropy's) compute on the
        local tensors, and their temporaries would otherwise go unseen. Handlers registered while
        the step runs (``loss_parallel()`` is entered inside it) are wrapped at the next DTensor
        operator; the originals are put back at the end.
        """
        for op, handler in list(self._handlers.items()):
            if getattr(handler, "tracked_by", None) is not self:
                self._handlers[op] = self._tracked_handler(op, handler)

    def _tracked_handler(self, op, handler):
        def tracked(*args, **kwargs):
            TorchDispatchMode.__enter__(self)
            try:
                return handler(*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)

        tracked.tracked_by = self
        self._wrapped[op] = (handler, tracked)
        return tracked

    def _see(self, storage: torch.UntypedStorage) -> None:
        # Keyed by the storage object's identity: PyTorch keeps one Python object per storage for
        # as long as the storage lives, and the finalizer removes the key before the identity can
        # be reused. The address alone would not do, since resizing a storage moves it.
        key = id(storage)
        nbytes, address = storage.nbytes(), storage.data_ptr()
        tracked = self._tracked.get(key)
        if tracked is not None:
            if tracked.nbytes != nbytes or tracked.data_ptr != address:
                self._by_address.pop(tracked.data_ptr, None)
                if address:
                    self._by_address[address] = key
                self._add(key, nbytes - tracked.nbytes)
                tracked.nbytes, tracked.data_ptr = nbytes, address
            return
        if address and address in self._by_address:
            return  # a second storage object over memory already counted
        finalizer = weakref.finalize(storage, self._freed, key)
        finalizer.atexit = False
        self._tracked[key] = _Tracked(nbytes=nbytes, data_ptr=address, finalizer=finalizer)
        if address:
            self._by_address[address] = key
        self._add(key, nbytes)

    def _freed(self, key: int) -> None:
        tracked = self._tracked.pop(key, None)
        if tracked is None:
            return
        if self._by_address.get(tracked.data_ptr) == key:
            del self._by_address[tracked.data_ptr]
        self.current -= tracked.nbytes
        if self.detail:
            self._events.append((key, -tracked.nbytes, ""))

    def _add(self, key: int, nbytes: int) -> None:
        self.current += nbytes
        if self.detail:
            self._events.append((key, nbytes, self._label))
        if self.current > self.peak:
            self.peak = self.current
            self._peak_at = len(self._events)

    def _made_by(self, op: str) -> str:
        """What makes a storage now: the operator, and the innermost module whose forward runs it.
        Autograd's backward and the optimizer run with grad mode off and outside every forward."""
        grad = torch.is_grad_enabled()
        running = self._modules.running if self._modules is not None else []
        if running:
            return f"{'forward' if grad else 'no grad'}: {op} in {running[-1]}"
        return f"outside modules: {op}" if grad else f"no grad (backward, optimizer): {op}"

    def at_peak(self) -> list[HeldAtPeak]:
        """The storages alive at the peak, grouped by what made them, largest first; their bytes
        add up to :attr:`peak`. Empty without ``detail``.

        A storage is named by what made it, or for one resized back (FSDP2's gathered blocks), by
        what resized it; the log is replayed up to the peak."""
        live: dict[int, tuple[int, str]] = {}
        for key, delta, label in self._events[:self._peak_at]:
            held, made_by = live.get(key, (0, label))
            if held + delta:
                live[key] = (held + delta, made_by if held else label)
            else:
                live.pop(key, None)
        grouped: dict[str, list[int]] = {}
        for held, made_by in live.values():
            entry = grouped.setdefault(made_by, [0, 0])
            entry[0] += held
            entry[1] += 1
        return sorted((HeldAtPeak(what=what, bytes=held, storages=count) for what, (held, count) in grouped.items()),
                      key=lambda entry: -entry.bytes)
