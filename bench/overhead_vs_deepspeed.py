"""Orchestration overhead: `orch train` against the same DeepSpeed run launched by plain `torchrun`.

Both sides train the built-in GPT with the same plan (dp=2, a ZeRO stage), DeepSpeed config
(`orch.launchers.engines.deepspeed.config.build_ds_config`, checked against the one `orch` logs), data shards and
steps, and log every step. (a) is `python -m torch.distributed.run --nproc-per-node 2` running
`bench/plain_deepspeed.py`; (b) is `orch train` as a subprocess, tracked in a local sqlite
MLflow store, with its embedded Ray. Repetitions are interleaved (a, b, a, b, ...) because the
machine is shared: a burst of load from elsewhere then hits both sides, not one.

Measured from the outside, the same way for both: when each step's line appears after launch.

- steady-state step time: the slope of report time over step, after the warm-up steps;
- time to first step: launch to the first step's line (interpreter, imports, Ray, rendezvous,
  DeepSpeed setup, the first step);
- in-loop step time: the time the training loop itself measures for its forward, backward and
  step (the slowest rank; `orch`'s ``step_time_s`` metric), which leaves out the logging and
  polling around it.

    python -m bench.overhead_vs_deepspeed [--steps 300] [--repeats 4] [--zero-stage 1]
                                          [--markdown bench/results/overhead_vs_deepspeed.md]
"""

from __future__ import annotations

import re
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.harness import (
    DS_CONFIG_NOTE,
    PYTHON,
    REPO,
    SHARED_MACHINE_NOTE,
    TimedRun,
    bench_env,
    bench_parser,
    cpu_time_note,
    gpt_overrides,
    interleaved,
    median_spread,
    publish_results,
    ratio_row,
    verdict,
)
from bench.run_spec import same_run

TARGET = 1.03
FIRST_STEP_TARGET = 1.5
"""Time to the first step, orch over torchrun + plain DeepSpeed."""
RUN_ID = re.compile(r"MLflow run ([0-9a-f]{32})")
THREADS = re.compile(r"threads per rank: (\d+)")
PLAIN_STEP_TIME = re.compile(r"(?:step|at) (\d+)/\d+\b.*?step_time ([\d.]+)")


def plain_in_loop_step_s(run: TimedRun, warmup: int) -> float:
    """Median over the steady steps of the slowest rank's in-loop step time, from every rank's lines."""
    slowest: dict[int, float] = {}
    for line in run.output:
        if match := PLAIN_STEP_TIME.search(line):
            step = int(match.group(1))
            slowest[step] = max(slowest.get(step, 0.0), float(match.group(2)))
    return statistics.median(t for s, t in slowest.items() if s > warmup)


def orch_in_loop_step_s(run: TimedRun, tracking_uri: str, warmup: int) -> float:
    """Median over the steady steps of the ``step_time_s`` metric `orch` logged (already the slowest rank)."""
    from mlflow.tracking import MlflowClient

    run_id = next(m.group(1) for line in run.output if (m := RUN_ID.search(line)))
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, "step_time_s")
    return statistics.median(m.value for m in history if m.step > warmup)


def main() -> None:
    args = bench_parser(__doc__, steps=300, repeats=4, zero_stage=True).parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    run = same_run(gpt_overrides(args.zero_stage, args.steps), work)
    job = run.job
    plain_cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(REPO / "bench" / "plain_deepspeed.py"), "--job", str(run.job_path)]

    cpu_window = (args.warmup + 10, args.steps - 20)
    runs, failures = interleaved({"torchrun + DeepSpeed": plain_cmd, "orch train": run.orch_cmd}, args.repeats,
                                 cwd=work, env=bench_env(), cpu_at_steps=cpu_window)
    plain, orch = runs["torchrun + DeepSpeed"], runs["orch train"]
    run.check()
    plain_loop = [plain_in_loop_step_s(r, args.warmup) for r in plain]
    orch_loop = [orch_in_loop_step_s(r, run.tracking_uri, args.warmup) for r in orch]

    steady_a = [r.steady_step_s(args.warmup) for r in plain]
    steady_b = [r.steady_step_s(args.warmup) for r in orch]
    ratios = [b / a for a, b in zip(steady_a, steady_b, strict=True)]
    loop_ratios = [b / a for a, b in zip(plain_loop, orch_loop, strict=True)]
    first_a, first_b = [r.first_step_s for r in plain], [r.first_step_s for r in orch]
    first_ratios = [b / a for a, b in zip(first_a, first_b, strict=True)]
    cpu_a, cpu_b = [r.cpu_to_first_step_s for r in plain], [r.cpu_to_first_step_s for r in orch]
    wall_a, wall_b = [r.wall_s for r in plain], [r.wall_s for r in orch]
    # CPU per steady step, in ms: each rank's, and everything else of the run's together.
    rank_a, rest_a = zip(*[(1e3 * a, 1e3 * b) for a, b in (r.cpu_per_step_s(2) for r in plain)], strict=True)
    rank_b, rest_b = zip(*[(1e3 * a, 1e3 * b) for a, b in (r.cpu_per_step_s(2) for r in orch)], strict=True)
    threads = next((m.group(1) for line in plain[0].output if (m := THREADS.search(line))), "not reported")

    intro = (f"Built-in GPT (`model=gpt`: {job['model']['n_layer']} layers, d_model {job['model']['d_model']}, "
             f"seq_len {job['seq_len']}), dp=2 on 2 CPU ranks, ZeRO stage {args.zero_stage}, fp32, micro-batch "
             f"{job['micro_batch_size']}, {args.steps} steps logged every step; steady state = steps after "
             f"{args.warmup}. {args.repeats} repetitions of each side, interleaved. Values are medians over the "
             "repetitions with (min-max); the ratio column is the median of the per-repetition ratios "
             "(min-max).")
    # The rows without a target are written out: their empty last cell is "| |", where ratio_row's is "|  |".
    table = ["| | torchrun + DeepSpeed | orch train | orch / plain | target |",
             "|---|---:|---:|---:|---|",
             ratio_row("steady-state step time, wall clock (s)", steady_a, steady_b, "{:.4f}",
                       target=verdict(ratios, TARGET)),
             f"| in-loop step time, slowest rank (s) | {median_spread(plain_loop, '{:.4f}')} | "
             f"{median_spread(orch_loop, '{:.4f}')} | {median_spread(loop_ratios)} | |",
             ratio_row("time to first step (s)", first_a, first_b, "{:.1f}", "{:.2f}",
                       target=verdict(first_ratios, FIRST_STEP_TARGET)),
             f"| CPU time until the first step, every process on the machine (CPU-s) | "
             f"{median_spread(cpu_a, '{:.1f}')} | {median_spread(cpu_b, '{:.1f}')} | "
             f"{median_spread([b / a for a, b in zip(cpu_a, cpu_b, strict=True)], '{:.2f}')} | |",
             f"| CPU per step of each rank, steps {cpu_window[0]}-{cpu_window[1]} (ms) | "
             f"{median_spread(list(rank_a), '{:.1f}')} | {median_spread(list(rank_b), '{:.1f}')} | "
             f"{median_spread([b / a for a, b in zip(rank_a, rank_b, strict=True)])} | |",
             f"| CPU per step outside the ranks, the same steps (ms) | {median_spread(list(rest_a), '{:.2f}')} | "
             f"{median_spread(list(rest_b), '{:.2f}')} | | |",
             f"| launch to exit (s) | {median_spread(wall_a, '{:.1f}')} | {median_spread(wall_b, '{:.1f}')} | "
             f"{median_spread([b / a for a, b in zip(wall_a, wall_b, strict=True)], '{:.2f}')} | |"]
    notes = [SHARED_MACHINE_NOTE,
             cpu_time_note(),
             "- Both sides log every step (a loss all-reduce per step). Wall-clock times are taken when each "
             "step's line appears; the plain loop stamps its lines itself, `orch` prints a line when its driver "
             "has polled the step from the workers (every 0.5 s), so the slope is fitted over all steady steps.",
             "- `orch train` also does, and is charged for: the plan check and memory estimate, the matmul probe "
             "for MFU, the memory probe during step 2, MLflow tracking in sqlite (params, artifacts, per-step "
             "metrics, plots at the end), and starting and stopping its embedded Ray.",
             f"- Torch threads per rank: {threads} under torchrun (it sets OMP_NUM_THREADS=1); `orch`'s Ray actors "
             "have 1 CPU each, for which Ray sets OMP_NUM_THREADS=1. Both sides' ranks run at nice 0: `orch`'s "
             "embedded Ray starts its workers so (`RAY_worker_niceness=0`; Ray's own default is 15). Each side "
             "is launched in a session of its own, and with the kernel's autogroup scheduling the nice value "
             "only ranks processes within that session.",
             "- CPU per step is read from `/proc` for the launched process and its descendants when the lines of the "
             "window's first and last steps arrive: the two processes that used the most are the ranks, the "
             "rest is `torchrun`'s launcher, or `orch`'s driver (its MLflow metrics thread included) and Ray's "
             "servers. On 2 cores with a rank per core, what runs outside the ranks takes its time from them.",
             DS_CONFIG_NOTE]
    publish_results("Orchestration overhead: orch train vs torchrun + plain DeepSpeed", intro, table, notes, failures,
                    args.markdown)
    shutil.rmtree(work, ignore_errors=True)  # a failed run never gets here: its files stay for a look


if __name__ == "__main__":
    main()
