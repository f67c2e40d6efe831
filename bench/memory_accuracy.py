"""Planner accuracy: predicted vs measured per-device memory over a matrix of real runs.

Every plan of ZeRO 0-3 x optimizer offload on/off x activation checkpointing on/off that
DeepSpeed accepts (offload needs ZeRO >= 1: 14 plans) trains for a few steps with 2 workers
in Ray actors. Each worker measures its real peak tensor bytes during ``train.memory_probe_step``
and the tensor bytes it holds after that step (launchers/memory_probe.py). The MLflow run of
each plan holds both next to the prediction. The table compares the most loaded rank against
the planner's prediction for it.

    python bench/memory_accuracy.py [--markdown bench/results/memory_accuracy.md] [overrides...]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import sys
import tempfile
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_module  # noqa: E402

from orchestrator.config import register_configs, to_typed  # noqa: E402
from orchestrator.driver import run_training  # noqa: E402

# Big enough that model states dominate the process's incidental tensors (the corpus, RNG state).
MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.seq_len=128"]
RUN = ["train.steps=3", "train.log_every=3", "train.memory_probe_step=2", "train.eval_batches=1",
       "plan.micro_batch_size=8"]


def plans() -> list[list[str]]:
    matrix = []
    for stage, offload, ckpt in itertools.product(range(4), ("none", "cpu"), (False, True)):
        if stage == 0 and offload != "none":
            continue
        matrix.append([f"plan.zero_stage={stage}", f"plan.offload_optimizer={offload}",
                       f"plan.activation_checkpointing={str(ckpt).lower()}"])
    return matrix


def measure(overrides: list[str], tracking_uri: str) -> dict:
    register_configs()
    with initialize_config_module("conf", version_base="1.3"):
        cfg = compose("config", overrides=[*MODEL, *RUN, f"tracking.uri={tracking_uri}",
                                           "tracking.experiment=memory-accuracy", *overrides])
    result = run_training(*to_typed(cfg))
    last = result.reports[-1]
    predicted = result.estimate.per_device
    return {
        "plan": " ".join(o.split(".", 1)[1] for o in overrides),
        "predicted_peak": predicted.total,
        "measured_peak": max(r["measured_peak_bytes"] for r in last),
        "predicted_states": predicted.params + predicted.grads + predicted.optimizer_states,
        "measured_states": max(r["measured_state_bytes"] for r in last),
        "run_id": result.run_id,
    }


def table(rows: list[dict]) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f}"

    def err(pred: int, meas: int) -> str:
        return f"{100 * (pred - meas) / meas:+.1f}%"

    lines = ["| plan | predicted peak MiB | measured peak MiB | error | predicted states MiB | "
             "measured held MiB | error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['plan']} | {mib(r['predicted_peak'])} | {mib(r['measured_peak'])} | "
                     f"{err(r['predicted_peak'], r['measured_peak'])} | {mib(r['predicted_states'])} | "
                     f"{mib(r['measured_states'])} | {err(r['predicted_states'], r['measured_states'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every plan")
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="orch-bench-")
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        rows = [measure([*p, *args.overrides], f"sqlite:///{store}/mlflow.db") for p in plans()]
    finally:
        ray.shutdown()
    text = (f"Planner accuracy, {datetime.date.today()}, {platform.machine()} {platform.processor() or ''}"
            f" 2 CPU workers, model {' '.join(MODEL)}; `python bench/memory_accuracy.py`\n\n{table(rows)}\n")
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
