"""What `orch export` needs of a DeepSpeed run: whether its checkpoints can be consolidated, and
the whole model's fp32 weights from one of them."""

from __future__ import annotations

from pathlib import Path

import torch


def export_refusal(params: dict[str, str]) -> str | None:
    """Why the run with these tracked params cannot be consolidated, or None: DeepSpeed's
    converter joins ZeRO's data-parallel partitions, not tensor- or pipeline-parallel ones."""
    if params.get("plan.tp", "1") != "1" or params.get("plan.pp", "1") != "1":
        return (f"was trained with tp={params.get('plan.tp')} and pp={params.get('plan.pp')}; only "
                "data-parallel checkpoints are consolidated.")
    return None


def consolidated_weights(folder: Path, params: dict[str, str]) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from the verified checkpoint ``folder``. DeepSpeed's own
    converter reads the files with ``torch.load``, which :func:`ds_verified_loading` makes
    weights-only and limits to the files the manifest lists."""
    from orch.launchers.engines.deepspeed.checkpoint_files import ds_verified_loading

    with ds_verified_loading(folder):
        if int(params.get("plan.zero_stage", 0)) == 0:
            return torch.load(str(folder / "mp_rank_00_model_states.pt"), map_location="cpu")["module"]
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
