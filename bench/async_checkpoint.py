"""Checkpoint stall: how long the steps wait per checkpoint written in the background
(``train.async_checkpoint=true``: FSDP2 with DCP's ``async_save``; DeepSpeed with its files copied to
host memory and written by a thread) against one written in the step.

For each engine the same run (the built-in GPT widened to ~25M parameters, dp=2 on 2 CPU workers,
fp32: ~300 MB of model and Adam states per checkpoint; DeepSpeed at ZeRO-1) trains with synchronous
and with background checkpoints, alternately, in this process. Every report carries the seconds
its ranks spent in checkpoint saves since the previous report (the slowest rank's count); a report
per checkpoint gives the stall of each save. The last step's checkpoint is written at once in both
modes (a finished run ends with it published), so it is left out: the stall per save is the median
over the others. Losses of the two modes are compared too: a background save must not change what
is trained.

    python -m bench.async_checkpoint [--repeats 2] [--markdown bench/results/async_checkpoint.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import SHARED_MACHINE_NOTE, compose_config, header, publish

SAVES = 4
EVERY = 5
ENGINES = {"fsdp2": ["plan=fsdp2"], "deepspeed": ["plan.zero_stage=1"]}
"""Each engine's plan: the rest of the run is the same."""
RUN = ["plan.dp=2", "plan.precision=fp32", "plan.micro_batch_size=2", "model.d_model=512",
       "model.n_layer=8", "model.n_head=8", f"train.steps={SAVES * EVERY}", f"train.log_every={EVERY}",
       f"train.checkpoint_every={EVERY}", "train.eval_batches=1", "train.export=false", "tracking.enabled=false"]


def train(engine: str, background: bool, root: Path) -> dict:
    """One run; the stall of every checkpoint but the last, its losses and wall time."""
    from orch.config import to_typed
    from orch.run.driver import run_training

    cfg = compose_config(*ENGINES[engine], *RUN,
                         f"train.checkpoint_dir={root / engine / ('async' if background else 'sync')}",
                         f"train.async_checkpoint={str(background).lower()}")
    started = time.perf_counter()
    result = run_training(*to_typed(cfg))
    stalls = [max(r.checkpoint_s for r in reports) for reports in result.reports[:-1]]
    return {"stalls": stalls, "losses": [reports[0].loss for reports in result.reports],
            "wall_s": time.perf_counter() - started, "params": result.model.param_count}


def engine_rows(engine: str, runs: dict[bool, list[dict]]) -> tuple[list[str], float, float]:
    """The table rows of one engine, its stall ratio and the largest loss gap between modes."""
    sync = [s for run in runs[False] for s in run["stalls"]]
    bg = [s for run in runs[True] for s in run["stalls"]]
    loss_gap = max(abs(a - b) for run_a, run_b in zip(runs[False], runs[True], strict=True)
                   for a, b in zip(run_a["losses"], run_b["losses"], strict=True))
    rows = [f"| {engine} | {label} | {statistics.median(stalls):.3f} s ({min(stalls):.3f}-{max(stalls):.3f}) | "
            f"{len(stalls)} | {statistics.median(r['wall_s'] for r in runs[background]):.1f} s |"
            for label, stalls, background in (("in the step", sync, False), ("in the background", bg, True))]
    return rows, statistics.median(bg) / statistics.median(sync), loss_gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(ENGINES))
    parser.add_argument("--markdown", type=Path, help="write the results table here")
    args = parser.parse_args()
    results: dict[str, dict[bool, list[dict]]] = {engine: {False: [], True: []} for engine in args.engines}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for engine in args.engines:
                for background in ((False, True) if repeat % 2 == 0 else (True, False)):
                    results[engine][background].append(train(engine, background, Path(tmp) / str(repeat)))
    rows, notes = [], []
    for engine, runs in results.items():
        engine_table, ratio, loss_gap = engine_rows(engine, runs)
        rows += engine_table
        notes.append(f"- {engine}: stall ratio, background / in the step, **{ratio:.2f}** (medians); the losses "
                     f"of the two modes differ by at most {loss_gap:.2e} at any report.")
    params = next(iter(results.values()))[False][0]["params"]
    lines = [
        *header("Checkpoint stall: background against synchronous saves", sys.argv),
        f"dp=2 on 2 CPU workers, fp32, the built-in GPT at {params:,} parameters (DeepSpeed at ZeRO-1); "
        f"a checkpoint every {EVERY} steps, {SAVES - 1} per run timed (the last, written at once in both modes, "
        "left out).",
        "",
        "| engine | checkpoints | stall per save, median (min-max) | saves timed | run wall time, median |",
        "|---|---|---:|---:|---:|",
        *rows,
        "",
        *notes,
        "- The background stall is the copy of the state to host memory plus any write of the previous "
        "checkpoint still running when the next begins; on a GPU the copy crosses PCIe, on CPU it is a "
        "memory copy.",
        SHARED_MACHINE_NOTE,
    ]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
