"""Predicted step time and memory per pipeline schedule, by term, for a 70B and a 405B Llama shape.

For each model the tuner is run on declared H100 80 GB nodes (989 TFLOP/s bf16, 3.35 TB/s HBM3,
NVLink 4 at 450 GB/s per direction, one 400 Gb/s adapter per GPU, 132 SMs) at sequence 8192 with the
layout fixed (tp=8 and the model's pp) and the fsdp2 engine, whose pipeline runs every schedule;
everything else (recomputation, of every block or every 2nd or 4th, micro-batch, compile,
resharding) is searched. The table gives the
fastest plan that fits for each schedule, its predicted step time by term and its peak memory:
what each schedule buys at this scale, from the cost model's first-principles terms
(docs/tuner.md). Predictions only: none of these plans has run on a GPU.

    python -m bench.schedule_table [--markdown bench/results/schedule_table.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import PYTHON, header, publish, tune_json

H100 = ["cluster=a100_8x", "cluster.device_tflops=989", "cluster.device_memory_gb_per_s=3350",
        "cluster.intra_node_gbps=3600", "cluster.inter_node_gbps=400", "cluster.device_sm_count=132"]
# (preset, nodes of 8 H100s, pp, global batch in sequences of 8192 tokens)
SHAPES = [("llama3_70b", 128, 8, 1024), ("llama3_405b", 1024, 16, 2048)]
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 2),
             ("zbv", 2)]
TERMS = ("compute", "memory", "bubble", "tp", "dp", "pp", "optimizer")


def tune(preset: str, nodes: int, pp: int, batch: int) -> dict:
    command = [PYTHON, "-m", "orch", "tune", f"model={preset}", *H100, f"cluster.nodes={nodes}",
               "data.seq_len=8192", "plan.precision=bf16", f"train.global_batch_size={batch}", "tune.engines=[fsdp2]",
               "tune.tp=[8]", f"tune.pp=[{pp}]", "tune.pp_virtual_stages=[2,4]",
               "tune.recompute_every_n_layers=[1,2,4]", "tune.top_k=100000", "--json"]
    return tune_json(command, preset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    lines = header("Predicted step time and memory per pipeline schedule (fsdp2, tp=8, sequence 8192, "
                   "declared H100 80 GB)", sys.argv)
    lines += ["| model | devices | schedule | best plan that fits | step (s) | "
              + " | ".join(TERMS) + " | MFU | peak (GiB) |",
              "|---|---:|---|---|---:|" + "---:|" * len(TERMS) + "---:|---:|"]
    for preset, nodes, pp, batch in SHAPES:
        found = tune(preset, nodes, pp, batch)
        for schedule, virtual in SCHEDULES:
            fits = [c for c in found["candidates"] if c["feasible"] and c["plan"]["pp_schedule"] == schedule
                    and c["plan"]["pp_virtual_stages"] == virtual]
            name = f"{schedule}" + (f" v={virtual}" if virtual > 1 else "")
            if not fits:
                lines.append(f"| {preset} | {nodes * 8} | {name} | none fits | " + " | " * len(TERMS) + " | |")
                continue
            best = min(fits, key=lambda c: c["predicted"]["step_time_s"])
            plan, step = best["plan"], best["predicted"]
            reshard = str(plan["fsdp.reshard_after_forward"]).lower()
            every = plan.get("recompute_every_n_layers", 1)
            ckpt = plan["activation_checkpointing"] + (f" every {every}" if every > 1 else "")
            layout = (f"dp={plan['dp']} micro={plan['micro_batch_size']} accum={plan['grad_accum_steps']} "
                      f"ckpt={ckpt} reshard={reshard}"
                      + (" compiled" if plan["compile"] else "")
                      + (" seq-parallel" if plan["sequence_parallel"] else ""))
            terms = " | ".join(f"{step['parts_s'][t]:.2f}" for t in TERMS)
            lines.append(f"| {preset} | {nodes * 8} | {name} | {layout} | {step['step_time_s']:.2f} | {terms} | "
                         f"{100 * step['mfu']:.1f}% | {step['peak_bytes'] / 2**30:.1f} |")
    lines += ["", "Each row is the fastest plan that fits of that schedule among the tuner's candidates for "
              "`orch tune model=PRESET cluster=a100_8x` with the H100 speeds above, `tune.engines=[fsdp2] "
              "tune.tp=[8] tune.pp=[PP] tune.recompute_every_n_layers=[1,2,4]`, bf16, sequence 8192; terms in "
              "seconds per step (docs/tuner.md). "
              "Predictions only: the fsdp2 pipeline schedules ran on CPU workers, never on a GPU."]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
