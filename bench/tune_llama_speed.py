"""Tuner speed for Llama shapes: the whole `orch tune` command for Llama 3 8B, 70B and 405B at sequence 8192.

Each model is tuned as a user would run it, a fresh process per model (imports, config
composition, the model built on ``meta``, the probe, the search over tp x pp x dp, ZeRO stage,
offload, checkpointing and micro-batch), on declared A100 80 GB nodes (``cluster=a100_8x``) sized
as such models are trained: 32, 64 and 1024 devices. The issue's target is under 60 s each. The
command's own lines say how long the probe and the search took; the wall time is measured from
outside. The tuned plan file goes to a temporary directory.

    python -m bench.tune_llama_speed [--repeats 1] [--markdown bench/results/tune_llama_speed.md]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import PYTHON, bench_env, header, publish

# (preset, nodes of 8 devices, global batch in sequences of 8192 tokens)
SHAPES = [("llama3_8b", 4, 256), ("llama3_70b", 8, 512), ("llama3_405b", 128, 2048)]
PROBED = re.compile(r"model probed on meta in ([0-9.]+)s")
SEARCHED = re.compile(r"searched (\d+) plans in ([0-9.]+)s: (\d+) fit")
WINNER = re.compile(r"winner \(best predicted\): (.*)")


def tune_command(preset: str, nodes: int, batch: int) -> list[str]:
    return [PYTHON, "-m", "orch", "tune", f"model={preset}", "cluster=a100_8x", f"cluster.nodes={nodes}",
            "data.seq_len=8192", "plan.precision=bf16", f"train.global_batch_size={batch}"]


def run_once(preset: str, nodes: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        started = time.perf_counter()
        done = subprocess.run(tune_command(preset, nodes, batch), cwd=cwd, env=bench_env(), capture_output=True,
                              text=True, check=False)
        wall = time.perf_counter() - started
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"orch tune {preset} exited {done.returncode}:\n{out[-2000:]}")
    searched = SEARCHED.search(out)
    return {"wall": wall, "probe": float(PROBED.search(out).group(1)), "search": float(searched.group(2)),
            "plans": int(searched.group(1)), "fit": int(searched.group(3)), "winner": WINNER.search(out).group(1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    runs = {preset: [run_once(preset, nodes, batch) for _ in range(args.repeats)] for preset, nodes, batch in SHAPES}
    lines = header("Tuner speed: orch tune for Llama 3 shapes at sequence 8192", sys.argv)
    lines += ["| model | devices | global batch | plans searched | fit | probe (s) | search (s) | "
              "`orch tune` wall (s) | under 60 s | winner |",
              "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---|"]
    for preset, nodes, batch in SHAPES:
        r = runs[preset]
        probe, search, wall = (statistics.median(x[key] for x in r) for key in ("probe", "search", "wall"))
        lines.append(f"| {preset} | {nodes * 8} | {batch} | {r[0]['plans']} | {r[0]['fit']} | "
                     f"{probe:.1f} | {search:.1f} | "
                     f"{wall:.1f} | {'yes' if max(x['wall'] for x in r) < 60 else 'no'} | {r[0]['winner']} |")
    lines += ["", f"Median of {args.repeats} run(s) each; the wall time includes imports (several seconds of "
              "torch, DeepSpeed and transformers) and building the model on meta. `orch tune model=PRESET "
              "cluster=a100_8x cluster.nodes=N data.seq_len=8192 plan.precision=bf16 train.global_batch_size=B`."]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
