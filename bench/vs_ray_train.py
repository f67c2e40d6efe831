"""Versus Ray Train: the same DeepSpeed loop run by Ray Train's `TorchTrainer` and by `orch train`.

Ray Train runs `bench/plain_deepspeed.py`'s loop (`train_loop_per_worker`) on 2 workers with
1 CPU each, on a local Ray the script starts, as `orch` starts its embedded one; `orch train`
runs the same model, plan, DeepSpeed config, data and steps. Each side is a fresh subprocess
and is timed from launch: wall time to the N-th step, time to the first step, and launch to
exit. Repetitions are interleaved (Ray Train, orch, Ray Train, ...) on this shared machine.

Ray Train is an optional extra (``pip install -e ".[bench]"``); without it the script says so
and exits.

    python -m bench.vs_ray_train [--steps 100] [--repeats 3] [--zero-stage 1]
                                 [--markdown bench/results/vs_ray_train.md]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from bench.harness import (
    DS_CONFIG_NOTE,
    PYTHON,
    SHARED_MACHINE_NOTE,
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

GIB = 1024**3
THREADS = re.compile(r"threads per rank: (\d+)")

FIRST_STEP_TARGET = 0.6
"""Time to the first step, orch over Ray Train's TorchTrainer."""


def run_ray_train(job_path: Path, storage: Path) -> None:
    """The Ray Train side, run in its own process: start Ray, fit a TorchTrainer, stop Ray."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.plain_deepspeed import train_loop_per_worker
    from orch.launchers.ray_session import start_local_ray

    job = json.loads(job_path.read_text())
    # The same embedded Ray `orch` starts: 2 logical CPUs, a 1 GiB object store, no dashboard, on loopback.
    start_local_ray(num_cpus=2, object_store_memory=GIB)
    try:
        trainer = TorchTrainer(train_loop_per_worker, train_loop_config=job,
                               scaling_config=ScalingConfig(num_workers=job["world_size"], use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               run_config=RunConfig(name="bench", storage_path=str(storage)))
        trainer.fit()
    finally:
        ray.shutdown()


def main() -> None:
    # --ray-train-job is internal: the Ray Train side, run by this script in a process of its own.
    ray_train_job = {"type": Path, "help": argparse.SUPPRESS}
    args = bench_parser(__doc__, steps=100, warmup=None, repeats=3, zero_stage=True,
                        extra={"--ray-train-job": ray_train_job}).parse_args()
    try:  # the ray wheel always ships ray.train; without the [train] extra its imports fail
        import ray.train.torch  # noqa: F401
    except ImportError as error:
        sys.exit(f"Ray Train is not installed ({error}). It is an optional extra for this benchmark only: "
                 'pip install -e ".[bench]"')
    if args.ray_train_job:
        run_ray_train(args.ray_train_job, args.ray_train_job.parent / "ray_results")
        return

    from bench.run_spec import same_run

    work = Path(tempfile.mkdtemp(prefix="bench-raytrain-"))
    run = same_run(gpt_overrides(args.zero_stage, args.steps), work)
    ray_cmd = [PYTHON, str(Path(__file__).resolve()), "--ray-train-job", str(run.job_path)]

    runs, failures = interleaved({"Ray Train": ray_cmd, "orch train": run.orch_cmd}, args.repeats, cwd=work,
                                 env=bench_env())
    ray_runs, orch_runs = runs["Ray Train"], runs["orch train"]
    run.check()

    rows = [("wall time to step N (s)", lambda r: r.time_to_step(args.steps), 1.0),
            ("time to first step (s)", lambda r: r.first_step_s, FIRST_STEP_TARGET),
            ("CPU time until the first step, every process on the machine (CPU-s)",
             lambda r: r.cpu_to_first_step_s, None),
            ("launch to exit (s)", lambda r: r.wall_s, None)]
    threads = next((m.group(1) for line in ray_runs[0].output if (m := THREADS.search(line))), "not reported")
    intro = (f"Built-in GPT (`model=gpt`), dp=2 on 2 CPU workers, ZeRO stage {args.zero_stage}, fp32, "
             f"micro-batch {run.job['micro_batch_size']}, N = {args.steps} steps logged every step. {args.repeats} "
             "repetitions of each side, interleaved; medians with (min-max). The ratio column is the median of "
             "the per-repetition ratios (min-max). Targets: orch is not slower to step N (ratio <= 1), and reaches "
             f"its first step in at most {FIRST_STEP_TARGET:g}x Ray Train's time.")
    table = ["| | Ray Train TorchTrainer | orch train | orch / Ray Train | target |",
             "|---|---:|---:|---:|---|"]
    for name, measure, limit in rows:
        a, b = [measure(r) for r in ray_runs], [measure(r) for r in orch_runs]
        target = verdict([y / x for x, y in zip(a, b, strict=True)], limit) if limit else ""
        table.append(ratio_row(name, a, b, "{:.1f}", "{:.2f}", target=target))
    steady = [(r.steady_step_s(10), o.steady_step_s(10)) for r, o in zip(ray_runs, orch_runs, strict=True)]
    # No target: the empty last cell is "| |" here, where ratio_row's is "|  |".
    table.append(f"| steady-state step time after step 10 (s) | {median_spread([a for a, _ in steady], '{:.4f}')} | "
                 f"{median_spread([b for _, b in steady], '{:.4f}')} | "
                 f"{median_spread([b / a for a, b in steady])} | |")
    notes = [SHARED_MACHINE_NOTE,
             "- Both sides start their own local Ray (2 CPUs, 1 GiB object store, no dashboard) inside the timed "
             "process, and both end with an evaluation pass on the held-out data.",
             cpu_time_note(),
             "- Ray Train's step times come from the `t=` stamps its rank 0 prints (Ray forwards worker output "
             "with a delay, which is not counted against it); `orch`'s from when its driver prints the step.",
             "- `orch train` is also charged for its plan check, the matmul probe for MFU, the memory probe during "
             "step 2 and MLflow tracking in a local sqlite store (per-step metrics, artifacts, plots at the end); "
             "the Ray Train side tracks nothing.",
             f"- Torch threads per Ray Train worker: {threads}; `orch`'s Ray actors have 1 CPU each, so 1 thread.",
             DS_CONFIG_NOTE]
    publish_results("Versus Ray Train: orch train vs TorchTrainer running the same DeepSpeed loop", intro, table,
                    notes, failures, args.markdown)
    shutil.rmtree(work, ignore_errors=True)  # a failed run never gets here: its files stay for a look


if __name__ == "__main__":
    main()
