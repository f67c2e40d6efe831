"""Training engines side by side: the same model, plan and steps under DeepSpeed ZeRO-3 and PyTorch FSDP2.

Both sides are `orch train` as a subprocess on the 2 CPU workers (dp=2, bf16), tracked in a
local sqlite MLflow store; they differ only in ``plan.engine`` (``deepspeed`` with
``plan.zero_stage=3``, or ``fsdp2``, which always shards parameters, gradients and optimizer
states as ZeRO-3 does). Repetitions are interleaved (a, b, a, b, ...) because the machine is
shared: a burst of load from elsewhere then hits both sides, not one. Every ratio is FSDP2 over
ZeRO-3 within one repetition, so both runs of a ratio saw the same stretch of machine time.

Per engine:

- steady-state step time: the slope of when each step's line appears after launch, after the
  warm-up steps; and the in-loop step time (the slowest rank's forward, backward and step, the
  ``step_time_s`` metric `orch` logs), which leaves out logging and polling;
- time to first step: launch to the first step's line (imports, Ray, engine set-up, first step);
- measured peak memory per rank: the memory probe's ``memory/rank<i>/measured_peak_bytes``,
  beside the planner's ``memory/predicted_peak_bytes`` for the same run;
- the final training loss (``loss`` at the last step), which shows both engines trained the same
  model on the same data to about the same place.

    python -m bench.engines [--models gpt,vit] [--steps 60] [--repeats 2]
                            [--markdown bench/results/engines.md]
"""

from __future__ import annotations

import re
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.harness import (
    SHARED_MACHINE_NOTE,
    TimedRun,
    bench_env,
    bench_parser,
    interleaved,
    median_spread,
    orch_command,
    publish_results,
    ratio_row,
)

RUN_ID = re.compile(r"MLflow run ([0-9a-f]{32})")
RANK_PEAK = re.compile(r"memory/rank(\d+)/measured_peak_bytes")

GPT = ["model=gpt", "model.n_layer=4", "model.d_model=256"]
"""The built-in GPT at ~3.3M parameters: a step takes a fraction of a second on 2 CPU ranks."""

MODELS: dict[str, tuple[str, list[str], list[str]]] = {
    # name: (description, ZeRO-3 overrides, FSDP2 overrides); everything else is shared.
    "gpt": ("built-in GPT (4 layers, d_model 256, seq_len 128), micro-batch 8",
            [*GPT, "plan.zero_stage=3", "plan.precision=bf16"],
            [*GPT, "plan.engine=fsdp2", "plan.precision=bf16"]),
    # The shipped pair of recipes: the same torchvision ViT, data and micro-batch, one engine each.
    "vit": ("torchvision ViT of `experiment=vit_zero3_bf16` / `vit_fsdp_bf16` (4 layers, 32x32 images), "
            "micro-batch 16",
            ["experiment=vit_zero3_bf16"], ["experiment=vit_fsdp_bf16"]),
}
ENGINES = ("ZeRO-3", "FSDP2")


@dataclass
class Tracked:
    """What one run logged to MLflow that the step lines do not say."""

    in_loop_step_s: float
    rank_peaks: dict[int, float]
    predicted_peak: float
    final_loss: float
    engine: str
    startup: dict[str, float]
    """`orch`'s own split of launch to first step (``startup/<phase>_s``: check, tracking, ray, workers,
    setup, first_report)."""


def tracked(run: TimedRun, tracking_uri: str, warmup: int) -> Tracked:
    """Read back the run's metrics: the step-time median after warm-up, memory, loss and its engine param."""
    from mlflow.tracking import MlflowClient

    run_id = next(m.group(1) for line in run.output if (m := RUN_ID.search(line)))
    client = MlflowClient(tracking_uri=tracking_uri)
    data = client.get_run(run_id).data
    step_times = [m.value for m in client.get_metric_history(run_id, "step_time_s") if m.step > warmup]
    peaks = {int(m.group(1)): v for k, v in data.metrics.items() if (m := RANK_PEAK.fullmatch(k))}
    if not peaks:
        raise RuntimeError(f"{run.label}: run {run_id} logged no per-rank measured peak (memory probe off?)")
    return Tracked(statistics.median(step_times), peaks, data.metrics["memory/predicted_peak_bytes"],
                   data.metrics["loss"], data.params["plan.engine"],
                   {k.removeprefix("startup/").removesuffix("_s"): v for k, v in data.metrics.items()
                    if k.startswith("startup/")})


def mib(values: list[float]) -> list[float]:
    return [v / 2**20 for v in values]


def engine_row(name: str, zero: list[float], fsdp: list[float], fmt: str, ratio_fmt: str = "{:.2f}") -> str:
    """A row of the table: ZeRO-3, FSDP2 and FSDP2 / ZeRO-3 (the table has no target column)."""
    return ratio_row(name, zero, fsdp, fmt, ratio_fmt, target=None)


def model_rows(model: str, runs: dict[str, list[TimedRun]], logged: dict[str, list[Tracked]],
               warmup: int) -> list[str]:
    zero, fsdp = runs["ZeRO-3"], runs["FSDP2"]
    lz, lf = logged["ZeRO-3"], logged["FSDP2"]
    ranks = sorted(lz[0].rank_peaks)
    rows = [f"| **{model}** | | | |",
            engine_row("steady-state step time, wall clock (s)", [r.steady_step_s(warmup) for r in zero],
                       [r.steady_step_s(warmup) for r in fsdp], "{:.4f}", "{:.3f}"),
            engine_row("in-loop step time, slowest rank (s)", [t.in_loop_step_s for t in lz],
                       [t.in_loop_step_s for t in lf], "{:.4f}", "{:.3f}"),
            engine_row("time to first step (s)", [r.first_step_s for r in zero], [r.first_step_s for r in fsdp],
                       "{:.1f}"),
            *[engine_row(f"of which {phase} (s)", [t.startup[phase] for t in lz], [t.startup[phase] for t in lf],
                         "{:.1f}") for phase in ("setup", "first_report") if phase in lz[0].startup],
            engine_row("launch to exit (s)", [r.wall_s for r in zero], [r.wall_s for r in fsdp], "{:.1f}")]
    rows += [engine_row(f"measured peak, rank {rank} (MiB)", mib([t.rank_peaks[rank] for t in lz]),
                        mib([t.rank_peaks[rank] for t in lf]), "{:.1f}") for rank in ranks]
    rows += [engine_row("predicted peak per device (MiB)", mib([t.predicted_peak for t in lz]),
                        mib([t.predicted_peak for t in lf]), "{:.1f}"),
             "| predicted / measured peak (most loaded rank) | "
             f"{median_spread([t.predicted_peak / max(t.rank_peaks.values()) for t in lz], '{:.2f}')} | "
             f"{median_spread([t.predicted_peak / max(t.rank_peaks.values()) for t in lf], '{:.2f}')} | |",
             engine_row("final training loss", [t.final_loss for t in lz], [t.final_loss for t in lf], "{:.3f}",
                        "{:.3f}")]
    return rows


def main() -> None:
    models_option = {"default": "gpt,vit", "help": f"comma-separated, of {', '.join(MODELS)}"}
    parser = bench_parser(__doc__, steps=60, warmup=5, repeats=2, runs_of="engine", first={"--models": models_option})
    args = parser.parse_args()
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    shared = ["plan.dp=2", f"train.steps={args.steps}", "train.log_every=1", f"tracking.uri={tracking_uri}"]
    env = bench_env()
    rows, failures, described = [], [], []
    for model in models:
        description, zero_overrides, fsdp_overrides = MODELS[model]
        commands = {"ZeRO-3": orch_command(*zero_overrides, *shared), "FSDP2": orch_command(*fsdp_overrides, *shared)}
        runs, failed = interleaved(commands, args.repeats, cwd=work, env=env)
        failures += failed
        logged = {engine: [tracked(r, tracking_uri, args.warmup) for r in runs[engine]] for engine in ENGINES}
        # The runs really used the engine they are labelled with (the plan param `orch` logged).
        for engine, expected in (("ZeRO-3", "deepspeed"), ("FSDP2", "fsdp2")):
            if got := {t.engine for t in logged[engine]} - {expected}:
                raise RuntimeError(f"{model} {engine}: runs logged plan.engine={got}, expected {expected}")
        rows += model_rows(model, runs, logged, args.warmup)
        described.append(f"`{model}`: {description}")

    intro = (f"`orch train` on 2 CPU workers, dp=2, bf16, {args.steps} steps logged every step; steady state = "
             f"steps after {args.warmup}. Models: {'; '.join(described)}. ZeRO-3 is `plan.engine=deepspeed "
             "plan.zero_stage=3`; FSDP2 is `plan.engine=fsdp2` (each block, then the root, fully sharded; "
             f"bf16 compute, fp32 gradient reduction). {args.repeats} repetition(s) of each engine, interleaved. "
             "Values are medians over the repetitions with (min-max); the ratio column is the median of the "
             "per-repetition ratios FSDP2 / ZeRO-3 (min-max). Of the time to first step, `setup` is the "
             "workers building the model and the engine and `first_report` the first step until its report "
             "(`orch`'s `startup/*` metrics).")
    table = ["| | DeepSpeed ZeRO-3 | FSDP2 | FSDP2 / ZeRO-3 |", "|---|---:|---:|---:|", *rows]
    notes = [SHARED_MACHINE_NOTE,
             "- Measured peak is the memory probe's count on each rank during its probe step "
             "(`train.memory_probe_step`; `orch/launchers/memory_probe.py`): bytes of live tensor storages, "
             "tracked through every operator call, not the process RSS. It counts both engines the same way, "
             "their communication buffers included where torch allocates them (DeepSpeed's flat partitions "
             "and buckets, FSDP2's all-gather and reduce-scatter buffers; a DTensor counts as its local shard).",
             "- Both engines start from the same seed on the same data shards; bf16 rounding differs between "
             "them (DeepSpeed keeps fp32 master weights beside bf16 ones, FSDP2 casts its fp32 shards to bf16 "
             "for compute), so the final losses agree only approximately."]
    publish_results("Training engines: DeepSpeed ZeRO-3 vs PyTorch FSDP2", intro, table, notes, failures,
                    args.markdown)
    shutil.rmtree(work, ignore_errors=True)  # a failed run never gets here: its files stay for a look


if __name__ == "__main__":
    main()
