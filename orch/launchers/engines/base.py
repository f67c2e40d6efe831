"""The training-engine seam: what the worker's loop needs from DeepSpeed, FSDP2 or any other.

:class:`orch.launchers.worker.TrainWorker` is the loop (set up, step, report, checkpoint, finish) and
the link to the driver; an :class:`Engine` owns everything specific to how the model is wrapped,
sharded, stepped and saved, private-state patches included. The shape follows Ray Train's
``Backend`` and torchtitan's ``TrainSpec``: the loop calls the engine, never a library directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from orch.launchers.job import TrainJob
    from orch.plans.parallel.rank_layout import ParallelCoords


@dataclass(frozen=True, kw_only=True)
class BuiltModel:
    """What an engine reports once the model is built and wrapped (sent on to the driver)."""

    built: str
    """How the model was built: ``zero.Init``, ``whole (...)``, ``stages``, ``meta, then sharded``..."""
    params_at_build: int
    """Parameters this rank held right after building (a sharded build: only its share)."""
    params_on_rank: int
    """Parameters of the wrapped model this rank sees (a tensor-parallel shard: its part)."""
    optimizer: str
    """Which optimizer class runs the step (``deepspeed.FusedAdam``, ``torch.AdamW (fused)``)."""
    optimizer_note: str | None = None
    """Why the optimizer is not the one the plan asked for, if it is not."""


def describe_optimizer(optimizer) -> str:
    """The optimizer that steps the parameters, named by its implementation: ``deepspeed.FusedAdam``,
    ``deepspeed.DeepSpeedCPUAdam``, ``torch.AdamW (fused)``. An engine may pick the kernel from
    its config and what the node can build (DeepSpeed does, at ``initialize``), so the run records
    what it got."""
    if optimizer is None:
        return "none"
    kind = type(optimizer)
    name = f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    defaults = getattr(optimizer, "defaults", {}) or {}
    if defaults.get("fused"):
        return f"{name} (fused)"
    if defaults.get("foreach"):
        return f"{name} (foreach)"
    return name


def mean_objective(model, objective, val_batches: Iterator[Any], batches: int,
                   to_device: Callable[[Any], Any],
                   run: Callable[[Any, Any], tuple[Any, Any]] | None = None) -> dict[str, float]:
    """The objective's loss and its own metrics (its optional ``metrics(outputs, batch)``) on
    ``batches`` held-out batches, each a mean over them; ``model`` is put in evaluation mode for
    it and back in training mode after. What every engine's :meth:`Engine.evaluate` computes when
    one rank holds the whole forward (not a pipeline stage). ``run(model, batch)`` returns the
    outputs and the batch they answer, where the rank runs on a part of it (context parallelism)."""
    import torch

    from orch.plans.model.workload import call_model

    metrics = getattr(objective, "metrics", None)
    totals: dict[str, float] = {}
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(batches):
                batch = to_device(next(val_batches))
                if run is None:
                    outputs = call_model(model, batch)
                else:
                    outputs, batch = run(model, batch)
                found = {"loss": objective(outputs, batch), **(metrics(outputs, batch) if metrics else {})}
                for name, value in found.items():
                    totals[name] = totals.get(name, 0.0) + float(whole_tensor(value))
    finally:
        model.train()
    return {name: total / batches for name, total in totals.items()}


def whole_tensor(value: Any) -> Any:
    """``value`` as a plain tensor: a DTensor gathered whole (``full_tensor``, differentiable: a loss
    from logits split over the vocabulary is a replicated DTensor), anything else as it is."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def cast_float_buffers(module, dtype) -> None:
    """Cast ``module``'s floating-point buffers (BatchNorm's running statistics) to ``dtype``.

    Both engines cast the parameters to the training precision (or compute in it) but leave
    floating-point buffers in fp32, which the layers then refuse to mix with the cast weights."""
    for buffer in module.buffers():
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype)


class Engine(ABC):
    """One rank's training engine. Created empty; :meth:`start` joins the process group,
    :meth:`build` wraps the model, and the loop then calls the rest."""

    name: ClassVar[str]
    """The ``plan.engine`` value that selects it."""

    device: torch.device
    """Where this rank's batches go (set by :meth:`start`)."""

    dtype: torch.dtype | None = None
    """What floating-point inputs are cast to (the training precision; None: as they come)."""

    def to_device(self, batch: Any) -> Any:
        """``batch`` on this rank's device, its floating-point tensors in :attr:`dtype`."""
        from orch.plans.model.workload import move_batch

        return move_batch(batch, self.device, self.dtype)

    @abstractmethod
    def start(self, job: TrainJob, master_addr: str, master_port: int) -> None:
        """Join the run's process group (the rendezvous variables are already in the environment)."""

    @abstractmethod
    def build(self, job: TrainJob, coords: ParallelCoords) -> BuiltModel:
        """Build, shard and wrap the model and its optimizer and learning-rate schedule."""

    @abstractmethod
    def train_step(self, batches: Iterator[Any], milestone: Callable[[str], None]) -> float:
        """One optimizer step over ``plan.grad_accum_steps`` micro-batches drawn from ``batches``.

        Returns this rank's mean micro-batch loss. ``milestone`` is called after every forward,
        backward and optimizer step with the phase that ended (``"forward"``, ``"backward"``,
        ``"optimizer"``; ``"pipeline"`` for a schedule that runs them in one call), so the driver
        can tell which rank a stalled run waits for and the step's time is measured by phase
        (:mod:`orch.launchers.step_phases`).
        """

    @abstractmethod
    def evaluate(self, val_batches: Iterator[Any], batches: int) -> dict[str, float]:
        """This rank's held-out ``loss`` and the objective's metrics, each a mean over ``batches``."""

    @abstractmethod
    def outputs(self, batch: Any) -> Any:
        """The model's outputs on one batch, in evaluation mode (export compares them)."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""

    @abstractmethod
    def save(self, root: str, tag: str, client_state: dict[str, Any]) -> None:
        """Write this rank's part of checkpoint ``tag`` under ``root``, with the loop's own state.

        Every rank calls it; the loop publishes the checkpoint (its manifest) afterwards.
        """

    def save_async(self, root: str, tag: str, client_state: dict[str, Any]) -> Callable[[], None] | None:
        """Start writing checkpoint ``tag`` in the background and return once the step may go on
        (the state copied to host memory), with a callable that waits until this rank's files are
        written; None when the engine cannot (the loop then calls :meth:`save`). Every rank calls
        it; the loop publishes the checkpoint only after every rank's wait returned."""
        return None

    @abstractmethod
    def load(self, root: str, tag: str) -> dict[str, Any]:
        """Restore model, optimizer and schedule from ``root/tag``, loading nothing that could run
        code or that its manifest does not list; return the loop's state saved with it."""

    @abstractmethod
    def consolidated_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights, on CPU on rank 0 (None elsewhere); every rank calls it.
        Raises where the plan's layout cannot be put back together (pipeline stages)."""

    def shutdown(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
