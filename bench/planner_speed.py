"""Planner speed: `orch check` for GPT-3 175B as the cluster grows, and plans estimated per second.

The model is built once on ``meta`` and its activations measured; then every cluster
size from 64 to 4096 declared 80 GiB devices is checked with ZeRO-3, and a sweep of plan
variants is estimated against the cached model to give plans per second. Times are relative to
the 64-device check in the same process (machines here are noisy).

Then the whole `orch check` command, as a user runs it, is timed at each cluster size: a fresh
process that composes the config, builds the model on ``meta``, measures its activations and
checks the plan (``--cli-repeats`` runs per size, interleaved over the sizes; the median is shown).
Last, the same command for the built-in GPT at depths from 2 to 10 million layers.

    python -m bench.planner_speed [--cli-repeats 3] [--markdown bench/results/planner_speed.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_module

from bench.harness import machine, publish
from orch.config import register_configs, to_typed
from orch.models import model_factory
from orch.plans.memory.estimate import ModelProbe, check_plan, estimate_plan
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Offload
from orch.workload import resolve_workload
from orch.workloads.gpt import TP_LAYER_SPECS

REPO = Path(__file__).resolve().parents[1]

SIZES = (64, 256, 1024, 4096)
BIG = ["model=gpt3_175b", "cluster=a100_8x", "plan.precision=bf16", "plan.micro_batch_size=1",
       "plan.zero_stage=3", "plan.activation_checkpointing=true"]


def config(nodes: int):
    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        return to_typed(compose("config", overrides=[*BIG, f"cluster.nodes={nodes}"]))


def cli_check_times(repeats: int) -> dict[int, list[float]]:
    """Wall time of a fresh `orch check --json` process per declared device count (sizes interleaved)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    times: dict[int, list[float]] = {devices: [] for devices in SIZES}
    for _ in range(repeats):
        for devices in SIZES:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "orch", "check", "--json", *BIG,
                                   f"cluster.nodes={devices // 8}"], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=600)
            times[devices].append(time.perf_counter() - started)
            if done.returncode not in (0, 1):  # 1 is a plan that does not fit, still a finished check
                raise RuntimeError(f"orch check failed at {devices} devices: {done.stderr[-2000:]}")
            if json.loads(done.stdout)["world_size"] != devices:
                raise RuntimeError(f"orch check planned for the wrong cluster size at {devices} devices")
    return times


DEPTHS = (2, 200, 2000, 20000, 10_000_000)
"""Layers of the built-in GPT (d_model 128) checked on the default 2-worker CPU cluster: a deep model
is built at 2 and 4 layers only, and 10 million layers are refused (exit 2) from that arithmetic."""


def deep_check_times(repeats: int) -> dict[int, tuple[list[float], int]]:
    """Wall time and exit code of a fresh `orch check --json model.n_layer=N` process per depth."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    times: dict[int, tuple[list[float], int]] = {depth: ([], 0) for depth in DEPTHS}
    for _ in range(repeats):
        for depth in DEPTHS:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "orch", "check", "--json", f"model.n_layer={depth}"],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            times[depth][0].append(time.perf_counter() - started)
            times[depth] = (times[depth][0], done.returncode)
            if done.returncode not in (0, 1, 2):
                raise RuntimeError(f"orch check failed at {depth} layers: {done.stderr[-2000:]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli-repeats", type=int, default=3, help="`orch check` processes per cluster size")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()

    typed, model_cfg, _ = config(8)
    started = time.perf_counter()
    probe = ModelProbe(model_factory(model_cfg), resolve_workload(model_cfg, typed.objective, typed.data),
                       tp_layer_specs=TP_LAYER_SPECS)
    probe.activations(resolve_plan(typed.plan, typed.cluster, typed.train))  # measured once per model
    build_s = time.perf_counter() - started

    rows = []
    for devices in SIZES:
        typed, _, _ = config(devices // 8)
        plan = resolve_plan(typed.plan, typed.cluster, typed.train)
        started = time.perf_counter()
        estimate = check_plan(plan, typed.cluster, typed.optim, probe)
        rows.append((devices, time.perf_counter() - started, estimate.per_device.total / 2**30, estimate.feasible))

    typed, _, _ = config(128)
    base = resolve_plan(typed.plan, typed.cluster, typed.train)
    variants = [dataclasses.replace(base, zero_stage=z, offload_optimizer=o, activation_checkpointing=c,
                                    micro_batch_size=m)
                for z, o, c, m in itertools.product(range(1, 4), (Offload.none, Offload.cpu), (False, True),
                                                    (1, 2, 4))]
    for v in variants:  # first pass measures the activations of each (micro-batch, checkpointing)
        estimate_plan(v, typed.cluster, typed.optim, probe)
    started = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
        for v in variants:
            estimate_plan(v, typed.cluster, typed.optim, probe)
    per_second = repeats * len(variants) / (time.perf_counter() - started)

    first = rows[0][1]
    lines = [f"Planner speed, {datetime.date.today()}, {machine()}, GPT-3 175B "
             f"({probe.stats.param_count:,} parameters), ZeRO-3 bf16; "
             f"`python -m bench.planner_speed --cli-repeats {args.cli_repeats}`", "",
             f"Building the model on meta and measuring its activations: {build_s:.2f} s (once per model; "
             "the checks below reuse it).", "",
             "| devices | check time (s) | relative to 64 | per-device peak (GiB) | fits |",
             "|---:|---:|---:|---:|:---:|"]
    lines += [f"| {d} | {t:.3f} | {t / first:.2f}x | {g:.2f} | {'yes' if f else 'no'} |" for d, t, g, f in rows]
    lines += ["", f"Plans estimated per second against the cached model: {per_second:,.0f} "
                  f"({len(variants)} variants x {repeats})."]
    cli = cli_check_times(args.cli_repeats)
    base = statistics.median(cli[SIZES[0]])
    lines += ["", f"The whole `orch check --json` command per cluster size: a fresh process each time (imports, "
                  f"config composition, the model on meta, activations, the check), {args.cli_repeats} runs per "
                  "size interleaved over the sizes; median (min-max). The machine is a 2-core VM that other jobs "
                  "can share (see the load averages above).", "",
              "| devices | `orch check` wall time (s) | relative to 64 |", "|---:|---:|---:|"]
    lines += [f"| {d} | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) | {statistics.median(t) / base:.2f}x |"
              for d, t in cli.items()]
    lines += ["", "`orch check model=gpt3_175b cluster=a100_8x cluster.nodes=N plan.precision=bf16 "
                  "plan.micro_batch_size=1 plan.zero_stage=3 plan.activation_checkpointing=true --json`"]
    deep = deep_check_times(args.cli_repeats)
    lines += ["", "`orch check --json model.n_layer=N` on the default cluster (2 CPU workers of 8 GiB), a fresh "
                  f"process each time, {args.cli_repeats} runs per depth; median (min-max). Exit 1: does not fit; "
                  "exit 2: refused before anything of its depth is built.", "",
              "| layers | `orch check` wall time (s) | exit code |", "|---:|---:|---:|"]
    lines += [f"| {d:,} | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) | {code} |"
              for d, (t, code) in deep.items()]
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
