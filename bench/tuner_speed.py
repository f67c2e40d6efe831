"""Tuner speed: analytic `orch tune` for GPT-3 175B as the declared cluster grows (64 -> 4096 A100s).

The model is probed once on ``meta`` (parameters, FLOPs with and without recomputation, the
operations and communication sizes of a layer); every cluster size is then searched with the
same probe, as ``orch tune`` does within one run. The first search also measures activations on
``meta`` (cached for the later ones), so it is reported apart. Times are absolute seconds on this
machine and, for growth, relative to the 64-device search in the same process. The model's
FLOPs and activations are counted at two shallow depths and extrapolated (orch/plans/model/depth_scaling.py);
the benchmark also counts all 96 layers, as before that, and reports the ratios and whether the
two counts agree.

    python -m bench.tuner_speed [--markdown bench/results/tuner_speed.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from bench.harness import compose_config, header, publish
from orch.config import to_typed
from orch.plans.memory.activations import measure_activations, measure_activations_depth_scaled
from orch.plans.search.space import search
from orch.plans.step_time.model_cost import measure_model_cost
from orch.tune.search import prepare

REPO = Path(__file__).resolve().parents[1]

NODES = [8, 32, 128, 512]  # x 8 devices: 64, 256, 1024, 4096
OVERRIDES = ["model=gpt3_175b", "cluster=a100_8x", "plan.precision=bf16", "train.global_batch_size=1536"]


def _timed(fn, *args, **kwargs):
    """``fn``'s result and the seconds it took."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args()
    cfg, model_cfg, _ = to_typed(compose_config(*OVERRIDES, f"cluster.nodes={NODES[0]}"))
    started = time.perf_counter()
    space, ctx = prepare(cfg, model_cfg, cfg.cluster)
    probe_s = time.perf_counter() - started
    first = search(space, ctx)  # also measures activations on meta, cached for the rest
    tp_degrees = sorted(ctx.model_cost.tp_param_count)
    # The full-depth model on meta, built for the comparisons only (the tuner probes it from shallow
    # copies) and before the timings, which count the passes and not the building.
    full_model = ctx.probe.module
    scaled, scaled_s = _timed(measure_model_cost, ctx.probe, tp_degrees, depth_scaled=True)
    full, full_s = _timed(measure_model_cost, ctx.probe, tp_degrees)
    activation_args = dict(micro_batch_size=1, inputs=ctx.probe.inputs, dtype=torch.bfloat16,
                           checkpointing=True)
    scaled_act, scaled_act_s = _timed(measure_activations_depth_scaled, full_model, **activation_args)
    full_act, full_act_s = _timed(measure_activations, full_model, **activation_args)
    rows = []
    for nodes in NODES:
        cluster = dataclasses.replace(cfg.cluster, nodes=nodes)
        result = search(dataclasses.replace(space, world_size=cluster.world_size),
                        dataclasses.replace(ctx, cluster=cluster))
        best = result.best.plan if result.best else None
        rows.append((cluster.world_size, result.enumerated, len(result.ranked), result.seconds,
                     f"dp={best.dp} tp={best.tp} pp={best.pp} zero={best.zero_stage}" if best else "none fits"))
    base = rows[0][3]
    lines = ["| devices | plans enumerated | fit | search s | vs 64 devices | best predicted |",
             "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {d} | {n} | {fit} | {s:.2f} | {s / base:.2f}x | {best} |" for d, n, fit, s, best in rows]
    publish([*header("Tuner speed: analytic `orch tune` for GPT-3 175B", sys.argv),
             f"Model probe on meta: {probe_s:.1f} s. First search (64 devices, measuring activations on meta "
             f"as it goes): {first.seconds:.1f} s. Of the probe, counting FLOPs at depths 2 and 4: "
             f"{scaled_s:.1f} s, against {full_s:.1f} s counting all {full.n_layers} layers "
             f"({scaled_s / full_s:.2f}x; the counts {'agree' if scaled == full else 'DIFFER'}). "
             f"Of the first search, measuring the activations and peaks of one checkpointed bf16 sample the "
             f"same way: {scaled_act_s:.1f} s, against {full_act_s:.1f} s at full depth "
             f"({scaled_act_s / full_act_s:.2f}x; the measurements {'agree' if scaled_act == full_act else 'DIFFER'}).",
             "", "Then, with those measurements cached:", "", *lines],
            args.markdown)

if __name__ == "__main__":
    main()
