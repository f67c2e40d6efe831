"""What a rank checkpoints besides the engine's own state: the step, the data position, the RNG
and the loss, and how a resume puts them back (on another data-parallel layout too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orch.launchers.checkpoint_io import CheckpointIO
from orch.launchers.engines import Engine
from orch.launchers.job import TrainJob


@dataclass(frozen=True, kw_only=True)
class Resumed:
    step: int
    """The optimizer step the checkpoint was written after."""
    loss: float
    """The rank's mean training loss checkpointed with that step (NaN from checkpoints without it)."""


def save_rank_state(checkpoints: CheckpointIO, engine: Engine, job: TrainJob, step: int, loss: float,
                    batches: Any, val_batches: Any, *, background: bool = False) -> None:
    """Checkpoint ``step`` (written in the background when ``background`` and the engine can:
    :meth:`CheckpointIO.save`). ``loss`` is this rank's mean training loss over the steps since its
    last report: an attempt resumed from the last step's checkpoint has no step left to train,
    and reports it."""
    import torch

    from orch.launchers.checkpoint import layout_of

    checkpoints.save(engine, step, {
        "step": step, "data": batches.state_dict(), "val_data": val_batches.state_dict(),
        "rng": torch.get_rng_state(), "layout": layout_of(job.plan), "loss": loss}, background=background)


def restore_rank_state(checkpoints: CheckpointIO, engine: Engine, job: TrainJob, tag: str,
                       batches: Any, val_batches: Any) -> Resumed:
    """Load the engine's state, then the data position and RNG; the data position is mapped
    onto this run's data-parallel degree and micro-batch size when the checkpoint's differ."""
    import torch

    client_state = checkpoints.restore(engine, tag)
    data, val_data = client_state["data"], client_state["val_data"]
    saved = client_state.get("layout")
    plan = job.plan
    if saved and (saved["dp"], saved["micro_batch_size"]) != (plan.dp, plan.micro_batch_size):
        from orch.launchers.checkpoint import resumed_position

        data = {**data, "position": resumed_position(data["position"], saved, plan.micro_batch_size, plan.dp)}
        val_data = {**val_data, "position": resumed_position(val_data["position"], saved,
                                                             plan.micro_batch_size, plan.dp)}
    batches.load_state_dict(data)
    val_batches.load_state_dict(val_data)
    torch.set_rng_state(client_state["rng"])
    return Resumed(step=int(client_state["step"]), loss=float(client_state.get("loss", float("nan"))))
