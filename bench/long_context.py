"""Long context: what `orch tune` finds for Llama 3 8B and 70B at a 128K-token sequence.

At 131,072 tokens a sample's activations do not fit one 80 GB device at any tp a node allows;
context parallelism (``plan.cp``: each rank keeps ``1/cp`` of every sequence, keys and values
gathered for attention) is what makes them fit. Each model is tuned as a user would run it, a
fresh process per model, on declared A100 80 GB nodes (``cluster=a100_8x``), with the default
search space (``tune.cp`` null: 1, 2, 4 and 8 at this length). The table gives the winner, its
predicted step time and parts, its peak memory, and how many of the plans that fit split the
sequence. The data is the shipped corpus repeated into a temporary file long enough for windows
of this length (the planner reads its size, not its text).

    python -m bench.long_context [--markdown bench/results/long_context.md]
"""

from __future__ import annotations

import argparse
import gzip
import sys
import tempfile
from pathlib import Path

from bench.harness import PYTHON, REPO, header, publish, tune_json

SEQ_LEN = 131072
# (preset, nodes of 8 devices, global batch in sequences)
SHAPES = [("llama3_8b", 8, 64), ("llama3_70b", 32, 128)]


def tune_command(preset: str, nodes: int, batch: int, data: Path) -> list[str]:
    return [PYTHON, "-m", "orch", "tune", f"model={preset}", "cluster=a100_8x", f"cluster.nodes={nodes}",
            f"data.path={data}", f"data.seq_len={SEQ_LEN}", "plan.precision=bf16",
            f"train.global_batch_size={batch}", "tune.top_k=1000", "--json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    corpus = gzip.open(REPO / "orch" / "workloads" / "corpus.txt.gz").read()
    lines = header(f"Long context: orch tune for Llama 3 shapes at sequence {SEQ_LEN}", sys.argv)
    lines += ["| model | devices | global batch | plans that fit | of them cp > 1 (top 1000) | winner | step (s) | "
              "parts (s) | MFU | peak memory (GiB) |", "|---|---:|---:|---:|---:|---|---:|---|---:|---:|"]
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "corpus.txt"
        data.write_bytes(corpus * 80)
        for preset, nodes, batch in SHAPES:
            found = tune_json(tune_command(preset, nodes, batch, data), preset)
            ranked = found["candidates"]
            best = found["best"]
            step = best["predicted"]
            parts = ", ".join(f"{name} {seconds:.3g}" for name, seconds in step["parts_s"].items() if seconds > 0)
            split = sum(1 for c in ranked if c["plan"]["cp"] > 1)
            plan = best["plan"]
            layout = " ".join(f"{key}={plan[key]}" for key in ("engine", "dp", "tp", "pp", "cp",
                                                                 "activation_checkpointing", "micro_batch_size",
                                                                 "grad_accum_steps", "sequence_parallel"))
            lines.append(f"| {preset} | {nodes * 8} | {batch} | {found['feasible']} | {split} | {layout} | "
                         f"{step['step_time_s']:.1f} | {parts} | {100 * step['mfu']:.1f}% | "
                         f"{step['peak_bytes'] / 2**30:.1f} |")
    lines += ["", f"`orch tune model=PRESET cluster=a100_8x cluster.nodes=N data.path=FILE data.seq_len={SEQ_LEN} "
              "plan.precision=bf16 train.global_batch_size=B`, declared speeds (312 TFLOP/s bf16, 2 TB/s); "
              "predictions only: context parallelism has never run on a GPU."]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
