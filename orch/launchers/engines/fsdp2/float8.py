"""``plan.precision=fp8``: the repeated blocks' linear layers multiply in FP8 (torchao's float8 training).

``torchao.float8.convert_to_float8_training`` swaps each chosen ``nn.Linear`` for a ``Float8Linear``
that keeps its bf16 weight and bias (the same names, so checkpoints move between bf16 and fp8 runs)
and casts both operands of its forward, input-gradient and weight-gradient matmuls to FP8 with a
scale per tensor or per row (``plan.fp8_recipe``), as torchtitan's float8 converter does. Only
layers inside the repeated blocks are converted, never the output head (whose small errors the
loss feels first), and only those whose widths are multiples of 16 (what FP8 tensor cores take).
Applied before tensor parallelism and FSDP2, which shard a ``Float8Linear`` as they shard a Linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orch.plans.resolve import ResolvedPlan

def fp8_device_problem(device: torch.device) -> str | None:
    """Why ``device`` has no FP8 matmuls, or None: CUDA GPUs of compute capability 8.9 (Ada) and
    later have them (H100 is 9.0)."""
    import torch

    if device.type != "cuda":
        return f"FP8 matmuls need a CUDA GPU, and this worker trains on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 matmuls; "
                "they start at 8.9 (H100 is 9.0)")
    return None


def convert_blocks_to_fp8(blocks: list[torch.nn.Module], plan: ResolvedPlan, device: torch.device) -> int:
    """Swap the eligible linear layers of ``blocks`` for torchao's ``Float8Linear``; returns how many."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from orch.plans.step_time.cost_model import FP8_WIDTH_MULTIPLE

    if (problem := fp8_device_problem(device)) is not None:
        raise RuntimeError(f"plan.precision=fp8: {problem}; set plan.precision=bf16")
    config = Float8LinearConfig.from_recipe_name(plan.fp8_recipe.value)

    def eligible(module: torch.nn.Module, _name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and module.in_features % FP8_WIDTH_MULTIPLE == 0
                and module.out_features % FP8_WIDTH_MULTIPLE == 0)

    converted = 0
    for block in blocks:
        converted += sum(eligible(module, name) for name, module in block.named_modules())
        convert_to_float8_training(block, config=config, module_filter_fn=eligible)
    return converted
