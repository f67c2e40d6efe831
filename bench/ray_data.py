"""Streaming through Ray Data: `orch train data=ray` against the same tokens in memory, and on data
far larger than Ray's object store.

Three sides train the built-in GPT on byte tokens of the shipped corpus, in windows of the same
length:
- `data=corpus` slices one uint8 tensor held in each worker's memory (the baseline);
- `data=ray` streams the same text from parquet files through Ray Data (read, hash-split, packed
  by Ray Data tasks, handed to the replicas through `streaming_split`);
- `data=ray` over the corpus repeated until the text is several times the object store given to
  Ray (`cluster.object_store_memory_gib`): a read that materialized the dataset could not hold it,
  and would have to read all of it before the first step.

Repetitions are interleaved. Reported: the steady-state step time against the baseline, and the
time to the first step of the large stream against the small one (streaming: the same).

    python -m bench.ray_data [--steps 150] [--repeats 2] [--scale 2000] [--markdown bench/results/ray_data.md]
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

from bench.harness import bench_env, bench_parser, interleaved, median_spread, orch_command, publish_results

OBJECT_STORE_GIB = 0.25


def write_parquet(root: Path, lines: list[str], copies: int, files: int) -> int:
    """``copies`` of the corpus's lines in ``files`` parquet files; returns the text's bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    per_file = max(copies // files, 1)
    for f in range(files):
        # Without dictionary encoding: the repeated lines would encode to a fraction of their
        # size, and Ray sizes parquet read tasks by the encoded size (one task would read all).
        pq.write_table(pa.table({"text": lines * per_file}), root / f"part{f:03d}.parquet", use_dictionary=False)
    return sum(len(line) + 1 for line in lines) * per_file * files


def main() -> None:
    args = bench_parser(__doc__, steps=150, repeats=2, extra={
        "--scale": {"type": int, "default": 2000, "help": "copies of the corpus in the large stream"},
        "--files": {"type": int, "default": 100, "help": "parquet files of the large stream"},
    }).parse_args()

    from orch.workloads.corpus import SHIPPED_CORPUS

    work = Path(tempfile.mkdtemp(prefix="bench-ray-data-"))
    lines = gzip.open(SHIPPED_CORPUS, "rt", encoding="utf-8").read().splitlines()
    small_bytes = write_parquet(work / "small", lines, copies=1, files=1)
    large_bytes = write_parquet(work / "large", lines, copies=args.scale, files=args.files)
    common = ["model=gpt", "plan.dp=2", "plan.zero_stage=1", f"train.steps={args.steps}", "train.log_every=1",
              "train.eval_every=50", "tracking.enabled=false", "train.export=false",
              f"cluster.object_store_memory_gib={OBJECT_STORE_GIB}"]
    commands = {"memory": orch_command(*common, "data=corpus"),
                "ray": orch_command(*common, "data=ray", f"data.paths=[{work / 'small'}]"),
                "ray_large": orch_command(*common, "data=ray", f"data.paths=[{work / 'large'}]")}
    runs, failures = interleaved(commands, args.repeats, cwd=work, env=bench_env())
    steady = {label: [r.steady_step_s(args.warmup) for r in found] for label, found in runs.items()}
    first = {label: [r.first_step_s for r in found] for label, found in runs.items()}

    def ratios(a: list[float], b: list[float]) -> str:
        return median_spread([y / x for x, y in zip(a, b, strict=True)])

    gib = 1024**3
    intro = (
        f"Built-in GPT, dp=2 on 2 CPU workers, ZeRO-1, fp32, seq_len 128, micro-batch 8, {args.steps} steps, byte "
        f"tokens of the shipped corpus; Ray's object store capped at {OBJECT_STORE_GIB} GiB. The small stream is the "
        f"corpus once ({small_bytes / 1e6:.1f} MB of text), the large one {args.scale} copies in {args.files} parquet "
        f"files ({large_bytes / gib:.2f} GiB of text, as many bytes of uint8 token windows: "
        f"{large_bytes / gib / OBJECT_STORE_GIB:.1f}x the object store). Steady state = steps after "
        f"{args.warmup}; held-out loss every 50 steps. {args.repeats} repetitions of each side, interleaved; medians "
        "with (min-max).")
    table = [
        "| | data=corpus (in memory) | data=ray, small | data=ray, large | small / memory | large / small |",
        "|---|---:|---:|---:|---:|---:|",
        f"| steady-state step time, wall clock (s) | {median_spread(steady['memory'], '{:.4f}')} | "
        f"{median_spread(steady['ray'], '{:.4f}')} | {median_spread(steady['ray_large'], '{:.4f}')} | "
        f"{ratios(steady['memory'], steady['ray'])} | {ratios(steady['ray'], steady['ray_large'])} |",
        f"| time to first step (s) | {median_spread(first['memory'], '{:.1f}')} | "
        f"{median_spread(first['ray'], '{:.1f}')} | {median_spread(first['ray_large'], '{:.1f}')} | "
        f"{ratios(first['memory'], first['ray'])} | {ratios(first['ray'], first['ray_large'])} |"]
    notes = ["- On 2 cores the Ray Data tasks (read, hash-split, pack) share the CPUs with the 2 training workers; "
             "a cluster with CPUs beside its training workers' keeps them apart."]
    publish_results("Streaming data: data=ray vs the same tokens in memory, and on data larger than the object store",
                    intro, table, notes, failures, args.markdown)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
