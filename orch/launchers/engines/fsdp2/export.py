"""What `orch export` needs of an FSDP2 run: its checkpoints are consolidated at any dp and tp
(``torch.distributed.checkpoint`` joins the shards as it loads)."""

from __future__ import annotations

from pathlib import Path

import torch


def export_refusal(params: dict[str, str]) -> str | None:
    """None: every FSDP2 checkpoint can be consolidated."""
    return None


def consolidated_weights(folder: Path, params: dict[str, str]) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from the verified checkpoint ``folder``; its metadata is
    read with an allow-list and its data files only as the manifest lists them
    (:func:`orch.launchers.engines.fsdp2.dcp_files.full_model_state`)."""
    from orch.launchers.engines.fsdp2.dcp_files import full_model_state

    return {name: tensor.float() for name, tensor in full_model_state(folder).items()}
