"""bf16 training steps on this CPU through torch's own kernels and through the fp32 path.

    python -m bench.cpu_bf16 [--rounds 5] [--markdown bench/results/cpu_bf16.md]

A CPU without bf16 instructions runs torch's bf16 GEMMs and convolutions as reference loops;
orch's CPU workers compute them in fp32 and round to bf16 (:mod:`orch.launchers.cpu_bf16`). This
times one forward and backward of the shipped models at their shipped micro-batches, in bf16, on
one thread (a CPU worker's share of a 2-core machine), both ways in alternating rounds, and
reports the medians and their ratio. The batches are random tensors of the data source's shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import compose_config, header, publish

CASES = {
    "GPT (model=gpt), micro-batch 4": ["plan.micro_batch_size=4"],
    "torchvision ViT (experiment=vit_zero3_bf16), micro-batch 16": ["experiment=vit_zero3_bf16"],
}


def _real(batch):
    """Random tensors of the example batch's shapes: floats in bf16, integers 0 or 1 (a valid token
    id and class label for any vocabulary and class count)."""
    from orch.plans.model.workload import map_tensors

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=torch.bfloat16)
        return torch.randint(0, 2, t.shape, dtype=t.dtype)
    return map_tensors(batch, fill)


def _case(overrides: list[str]):
    from orch.config import to_typed
    from orch.workload import resolve_workload

    cfg, model_cfg, _ = to_typed(compose_config(*overrides))
    workload = resolve_workload(model_cfg, cfg.objective, cfg.data)
    torch.manual_seed(0)
    model = workload.model_factory().to(torch.bfloat16)
    batch = _real(workload.example_batch(cfg.plan.micro_batch_size))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
    return step


def _seconds(step, widened: bool, repeats: int) -> float:
    import contextlib

    from orch.launchers.cpu_bf16 import _Bf16ViaFp32

    with _Bf16ViaFp32() if widened else contextlib.nullcontext():
        step()  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="steps timed per way and round")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    from orch.launchers.cpu_bf16 import cpu_has_bf16_kernels

    torch.set_num_threads(1)
    rows = []
    for name, overrides in CASES.items():
        step = _case(overrides)
        native, widened = [], []
        for _ in range(args.rounds):
            native.append(_seconds(step, False, args.repeats))
            widened.append(_seconds(step, True, args.repeats))
        ratio = statistics.median(n / w for n, w in zip(native, widened, strict=True))
        rows.append(f"| {name} | {statistics.median(native):.3f} | {statistics.median(widened):.3f} | {ratio:.1f} |")
    lines = [*header("bf16 forward+backward on one CPU thread: torch's kernels against the fp32 path", sys.argv),
             f"This CPU {'has' if cpu_has_bf16_kernels() else 'has no'} bf16 instructions "
             "(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); orch's workers take the fp32 path only where it "
             f"has none. Medians of {args.rounds} alternating rounds of {args.repeats} steps.", "",
             "| model | torch's bf16 kernels (s/step) | fp32 path (s/step) | speed-up (median of the rounds) |",
             "|---|---:|---:|---:|", *rows]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
