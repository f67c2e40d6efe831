"""Consecutive short runs in one driver, with the workers reused between them and without.

    python -m bench.worker_reuse [--runs 4] [--rounds 3] [--markdown bench/results/worker_reuse.md]

``orch tune``'s trials and ``orch calibrate``'s reference runs train one short run after another
on the same devices (:mod:`orch.launchers.worker_pool`). This trains ``--runs`` runs of the default
GPT on the local 2-worker CPU Ray (dp=2, ZeRO-1 and FSDP2 in turn, 10 steps each) once inside
``reusing_workers()`` and once outside, in alternating rounds, and reports each way's wall time
per run, its start-up (launch to the first report, as ``orch train`` prints it) and the machine's
CPU seconds per run, as medians over the rounds, with the ratio of reused to new. The same Ray serves
both ways; the machine is noisy, so the ratio is what to read.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from bench.harness import compose_config, header, machine_cpu_s, publish

PLANS = (["plan.zero_stage=1"], ["plan.engine=fsdp2"])


def _run(uri: str, index: int):
    from orch.config import to_typed
    from orch.run.driver import run_training

    cfg = compose_config("train.steps=10", "train.log_every=5", "train.eval_batches=1", "plan.micro_batch_size=4",
                         "train.export=false", f"tracking.uri={uri}", *PLANS[index % len(PLANS)])
    return run_training(*to_typed(cfg), stream=io.StringIO())


def one_way(uri: str, runs: int, reuse: bool) -> dict[str, float]:
    """Per run: wall seconds, start-up seconds, and the machine's CPU seconds (every process's:
    the driver's work is the same both ways, the workers' is what differs)."""
    import contextlib

    from orch.launchers.worker_pool import reusing_workers

    walls, startups = [], []
    cpu_before = machine_cpu_s()
    with reusing_workers() if reuse else contextlib.nullcontext():
        for index in range(runs):
            started = time.perf_counter()
            result = _run(uri, index)
            walls.append(time.perf_counter() - started)
            startups.append(result.time_to_first_report_s)
    cpu_after = machine_cpu_s()
    cpu = (cpu_after - cpu_before) / runs if cpu_before is not None and cpu_after is not None else float("nan")
    return {"wall_s": statistics.fmean(walls), "startup_s": statistics.fmean(startups), "cpu_s": cpu}


def main() -> None:
    from orch.launchers.ray_session import start_local_ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="consecutive runs per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="bench-reuse-")
    uri = f"sqlite:///{store}/mlflow.db"
    start_local_ray(num_cpus=2, object_store_memory=300 * 1024**2)
    found: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for round_index in range(args.rounds):
            for reuse in ((False, True) if round_index % 2 == 0 else (True, False)):
                found[reuse].append(one_way(uri, args.runs, reuse))
    finally:
        ray.shutdown()
    medians = {reuse: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
               for reuse, rounds in found.items()}
    rows = [("wall time per run (s)", "wall_s"), ("start-up per run (s)", "startup_s"),
            ("machine CPU per run (s)", "cpu_s")]
    title = (f"{args.runs} consecutive 10-step runs in one driver (dp=2 on 2 CPU workers, ZeRO-1 and FSDP2 in "
             f"turn), {args.rounds} alternating rounds")
    lines = [*header(title, sys.argv),
             "| per run, median of the rounds | new workers each run | reused workers | reused / new |",
             "|---|---:|---:|---:|"]
    for label, key in rows:
        new, reused = medians[False][key], medians[True][key]
        lines.append(f"| {label} | {new:.2f} | {reused:.2f} | {reused / new:.2f} |")
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
