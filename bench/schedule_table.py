"""Predicted step time and memory per pipeline schedule, by term, for a 70B and a 405B Llama shape.

For each model the tuner is run on declared H100 80 GB nodes (the ``h100_8x`` preset: 989 TFLOP/s bf16,
3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction, one 400 Gb/s adapter per GPU, 132 SMs) at sequence 8192 with the
layout fixed (tp=8 and the model's pp) and the fsdp2 engine, whose pipeline runs every schedule;
everything else (recomputation, of every block or every 2nd or 4th, micro-batch, compile,
async TP, resharding) is searched in bf16; then once more with tp and pp free, in bf16 and in fp8. The table gives the
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

H100 = ["cluster=h100_8x"]
# (preset, nodes of 8 H100s, pp, global batch in sequences of 8192 tokens, the pp degrees of the free search)
SHAPES = [("llama3_70b", 128, 8, 1024, (4, 8, 16)), ("llama3_405b", 1024, 16, 2048, (8, 16, 32))]
FREE_TP = (4, 8)
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 2),
             ("zbv", 2)]
TERMS = ("compute", "memory", "bubble", "tp", "dp", "pp", "optimizer")


def tune(preset: str, nodes: int, pp: tuple[int, ...], batch: int, tp: tuple[int, ...] = (8,),
         fp8: bool = False) -> dict:
    command = [PYTHON, "-m", "orch", "tune", f"model={preset}", *H100, f"cluster.nodes={nodes}",
               "data.seq_len=8192", "plan.precision=bf16", f"train.global_batch_size={batch}", "tune.engines=[fsdp2]",
               f"tune.fp8=[{str(fp8).lower()}]",
               f"tune.tp=[{','.join(map(str, tp))}]", f"tune.pp=[{','.join(map(str, pp))}]",
               "tune.pp_virtual_stages=[2,4]", "tune.recompute_every_n_layers=[1,2,4]", "tune.top_k=100000", "--json"]
    return tune_json(command, preset)


def row(preset: str, nodes: int, name: str, best: dict, *, layout_degrees: bool = False) -> str:
    """One table row: the plan, its step time by term, MFU and peak memory."""
    plan, step = best["plan"], best["predicted"]
    reshard = str(plan["fsdp.reshard_after_forward"]).lower()
    every = plan.get("recompute_every_n_layers", 1)
    ckpt = plan["activation_checkpointing"] + (f" every {every}" if every > 1 else "")
    degrees = f"tp={plan['tp']} pp={plan['pp']} " if layout_degrees else ""
    layout = (f"{degrees}dp={plan['dp']} micro={plan['micro_batch_size']} accum={plan['grad_accum_steps']} "
              f"ckpt={ckpt} reshard={reshard}"
              + (" compiled" if plan["compile"] else "")
              + (" seq-parallel" if plan["sequence_parallel"] else "")
              + (" async-tp" if plan.get("async_tp") else "")
              + (f" fp8/{plan['fp8_recipe']}" if plan["precision"] == "fp8" else ""))
    terms = " | ".join(f"{step['parts_s'][t]:.2f}" for t in TERMS)
    return (f"| {preset} | {nodes * 8} | {name} | {layout} | {step['step_time_s']:.2f} | {terms} | "
            f"{100 * step['mfu']:.1f}% | {step['peak_bytes'] / 2**30:.1f} |")


def fastest(found: dict, **where) -> dict | None:
    """The fastest plan that fits among ``found``'s candidates whose plan has the values ``where``."""
    fits = [c for c in found["candidates"]
            if c["feasible"] and all(c["plan"][key] == value for key, value in where.items())]
    return min(fits, key=lambda c: c["predicted"]["step_time_s"]) if fits else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    lines = header("Predicted step time and memory per pipeline schedule (fsdp2, tp=8, sequence 8192, "
                   "declared H100 80 GB)", sys.argv)
    lines += ["| model | devices | schedule | best plan that fits | step (s) | "
              + " | ".join(TERMS) + " | MFU | peak (GiB) |",
              "|---|---:|---|---|---:|" + "---:|" * len(TERMS) + "---:|---:|"]
    free_rows, fp8_rows = [], []
    for preset, nodes, pp, batch, free_pp in SHAPES:
        found = tune(preset, nodes, (pp,), batch)
        for schedule, virtual in SCHEDULES:
            name = f"{schedule}" + (f" v={virtual}" if virtual > 1 else "")
            best = fastest(found, pp_schedule=schedule, pp_virtual_stages=virtual)
            if best is None:
                lines.append(f"| {preset} | {nodes * 8} | {name} | none fits | " + " | " * len(TERMS) + " | |")
                continue
            lines.append(row(preset, nodes, name, best))
        free = fastest(tune(preset, nodes, free_pp, batch, FREE_TP))
        schedule = free["plan"]["pp_schedule"]
        virtual = free["plan"]["pp_virtual_stages"]
        free_rows.append(row(preset, nodes, schedule + (f" v={virtual}" if virtual > 1 else ""), free,
                             layout_degrees=True))
        fp8 = fastest(tune(preset, nodes, free_pp, batch, FREE_TP, fp8=True))
        fp8_rows.append(row(preset, nodes, fp8["plan"]["pp_schedule"] + (
            f" v={fp8['plan']['pp_virtual_stages']}" if fp8["plan"]["pp_virtual_stages"] > 1 else ""), fp8,
            layout_degrees=True))
    lines += ["", "Each row is the fastest plan that fits of that schedule among the tuner's candidates for "
              "`orch tune model=PRESET cluster=h100_8x`, `tune.engines=[fsdp2] "
              "tune.tp=[8] tune.pp=[PP] tune.recompute_every_n_layers=[1,2,4]`, bf16, sequence 8192; terms in "
              "seconds per step (docs/tuner.md); the output head split over the vocabulary on the last stage "
              "(`plan.loss_parallel`, on by default). "
              "Predictions only: the fsdp2 pipeline schedules ran on CPU workers, never on a GPU; async TP "
              "(`plan.async_tp`) has run only through torch's CPU fallbacks of its fused ops.",
              "", "The tuner's winner with the layout free as well (`tune.tp=[4,8]`, pp among the shape's listed "
              "degrees, every schedule):", "",
              "| model | devices | schedule | winner | step (s) | " + " | ".join(TERMS) + " | MFU | peak (GiB) |",
              "|---|---:|---|---|---:|" + "---:|" * len(TERMS) + "---:|---:|", *free_rows,
              "", "Free pp degrees: " + "; ".join(f"{preset} {', '.join(map(str, free_pp))}"
                                                   for preset, _, _, _, free_pp in SHAPES) + ".",
              "", "The same search in `plan.precision=fp8` (`tune.fp8=[true]`: the blocks' linear layers in FP8 at "
              "the preset's 1979 TFLOP/s; MFU still against the bf16 peak):", "",
              "| model | devices | schedule | winner | step (s) | " + " | ".join(TERMS) + " | MFU | peak (GiB) |",
              "|---|---:|---|---|---:|" + "---:|" * len(TERMS) + "---:|---:|", *fp8_rows]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
