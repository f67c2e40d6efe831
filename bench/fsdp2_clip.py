"""Gradient clipping in the fsdp2 engine: torch's foreach scaling against a loop of per-gradient multiplies.

    python -m bench.fsdp2_clip [--layers 100] [--markdown bench/results/fsdp2_clip.md]

On the H200 the fsdp2 engine's optimizer step took about 3x its prediction
(bench/results/gpu_smoke-nvidia-h200.md). Part of it is host time: every FSDP2 gradient is a
DTensor, and each multiply of a loop over ~200 of them (a 1B Llama) is a DTensor dispatch in Python.
``orch.launchers.engines.fsdp2.engine.clip_grad_norm`` scales them with torch's
``clip_grads_with_norm_`` (``scale_gradients``: one foreach multiply per mesh). This times that
scaling against the per-gradient loop it replaced (the norm before it is the same), in one process
on a one-rank gloo mesh, several rounds in alternation; the ratio is what to read (the machines are
noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def _sharded_grads(layers: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 64)).pow(2).sum().backward()
    return list(model.parameters())


def _per_gradient_loop(params, scale: float) -> None:
    """The baseline: one multiply per gradient."""
    for p in params:
        p.grad.mul_(scale)


def measure(layers: int, repeats: int = 5, calls: int = 20) -> dict[str, float]:
    """Median ms per call of each, over ``repeats`` alternating rounds of ``calls`` calls."""
    import torch.distributed as dist

    from orch.launchers.engines.fsdp2.engine import scale_gradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29541"), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        params = _sharded_grads(layers)
        # A norm just above max_norm: every call scales, by a factor so near 1 that the gradients
        # stay far from underflow over every call.
        max_norm, total = 1.0, 1.0 + 1e-5
        ways = {"per-gradient loop": lambda: _per_gradient_loop(params, max_norm / (total + 1e-6)),
                "orch scale_gradients (foreach per mesh)": lambda: scale_gradients(params, max_norm, total)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats):
            for name, call in ways.items():
                call()
                started = time.perf_counter()
                for _ in range(calls):
                    call()
                times[name].append((time.perf_counter() - started) / calls * 1e3)
        return {name: statistics.median(values) for name, values in times.items()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100, help="Linear layers, 2 parameters each")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    found = measure(args.layers)
    base = found["per-gradient loop"]
    lines = [f"# Scaling {2 * args.layers} clipped FSDP2 gradients (DTensors on a one-rank gloo mesh, CPU)", "",
             "| scaling | ms per call (median of 5 rounds of 20) | against the loop |", "|---|---:|---:|"]
    lines += [f"| {name} | {ms:.2f} | {ms / base:.2f} |" for name, ms in found.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
