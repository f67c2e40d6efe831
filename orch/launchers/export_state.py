"""The whole model's weights gathered for export, with a reference output to check them against."""

from __future__ import annotations

from typing import Any

from orch.launchers.engines import Engine


def consolidated_state(engine: Engine, val_batches: Any, rank: int, pp: int) -> dict | None:
    """The whole model's weights on rank 0 (on CPU), None elsewhere; every rank calls it.

    With them, the engine's output on one held-out batch, to check the exported model
    against. Pipeline-parallel plans are not consolidated: each stage holds other layers.
    """
    import torch

    from orch.plans.model.workload import move_batch, output_tensor

    if pp > 1:
        return None
    # The inputs as the engine saw them (cast to the training precision), for the export's check.
    batch = move_batch(val_batches.sample_batch(), "cpu", engine.dtype)
    output = output_tensor(engine.outputs(batch))
    state = engine.consolidated_state()
    if rank != 0:
        return None
    return {"state": state, "batch": move_batch(batch, "cpu", torch.float32),
            "output": output.detach().float().cpu()}
