"""The text data path's cost: `orch train data=text` against the same run fed from tokens in memory.

Both sides train the built-in GPT on the shipped corpus as byte tokens, in windows of the same
length: `data=corpus` slices one uint8 tensor held in each worker's memory; `data=text` reads the
same text through Hugging Face `datasets`, tokenized once into an Arrow cache that every worker
memory-maps (the cache is built before the timed runs, as a second run of any job finds it).
Repetitions are interleaved. The target is on the steady-state step time: the text path must not
slow training by more than 5%.

    python -m bench.text_data [--steps 200] [--repeats 3] [--markdown bench/results/text_data.md]
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bench.harness import bench_env, bench_parser, interleaved, orch_command, publish_results, ratio_row, verdict

TARGET = 1.05


def main() -> None:
    args = bench_parser(__doc__, steps=200, repeats=3).parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-text-"))
    cache = work / "cache"
    from orch.workloads.text import TextSource

    TextSource(seq_len=128, cache_dir=str(cache)).prepare()  # what the first run of a job would build
    common = ["model=gpt", "plan.dp=2", "plan.zero_stage=1", f"train.steps={args.steps}", "train.log_every=1",
              "tracking.enabled=false", "train.export=false"]
    commands = {"data=corpus (in memory)": orch_command(*common, "data=corpus"),
                "data=text (memory-mapped Arrow)": orch_command(*common, "data=text", f"data.cache_dir={cache}")}
    runs, failures = interleaved(commands, args.repeats, cwd=work, env=bench_env())
    memory, text = runs["data=corpus (in memory)"], runs["data=text (memory-mapped Arrow)"]
    steady_memory = [r.steady_step_s(args.warmup) for r in memory]
    steady_text = [r.steady_step_s(args.warmup) for r in text]
    ratios = [b / a for a, b in zip(steady_memory, steady_text, strict=True)]
    intro = (f"Built-in GPT, dp=2 on 2 CPU workers, ZeRO-1, fp32, seq_len 128, micro-batch 8, {args.steps} steps, "
             f"byte tokens of the shipped corpus on both sides; steady state = steps after {args.warmup}. "
             f"{args.repeats} repetitions of each side, interleaved; medians with (min-max).")
    table = ["| | data=corpus (in memory) | data=text (memory-mapped Arrow) | text / memory | target |",
             "|---|---:|---:|---:|---|",
             ratio_row("steady-state step time, wall clock (s)", steady_memory, steady_text, "{:.4f}",
                       target=verdict(ratios, TARGET)),
             ratio_row("time to first step (s)", [r.first_step_s for r in memory], [r.first_step_s for r in text],
                       "{:.1f}")]
    notes = ["- The tokenization cache is built once before the timed runs; building it for the shipped "
             "corpus (~500 KB) takes under a second."]
    publish_results("Text data path: data=text vs the same tokens in memory", intro, table, notes, failures,
                    args.markdown)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
