"""Sanity check of the tuner's cost model against published large-scale results (Megatron-LM, SC'21).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21) report the throughput of GPT models on DGX A100 nodes (8 x A100 80 GB,
NVLink 3, 8 x 200 Gb/s HDR InfiniBand per node) in their Table 1, and 140 TFLOP/s per GPU for
GPT-3 175B on 1024 GPUs at a batch of 1536 (section 5.1's training-time estimate). Here the cost
model predicts the same configurations from `cluster=a100_8x` as declared (no calibration), with
the built-in GPT at the paper's shapes (sequence 2048, vocabulary 51200), bf16, micro-batch 1, full
activation checkpointing, plain data parallelism (ZeRO-0: the paper predates Megatron's
distributed optimizer). The paper counts FLOPs with its closed form
``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (full recomputation included); the predicted TFLOP/s per
GPU is given both with that formula and with our counted FLOPs, since torch's checkpoint stops
recomputing early and so counts less work.

    python -m bench.megatron_sanity [--markdown bench/results/megatron_sanity.md]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from hydra import compose, initialize_config_module

from orchestrator.config import register_configs, to_typed
from orchestrator.models import model_factory
from plans.cost_model import Speeds, predict_step
from plans.estimate import ModelProbe
from plans.model_cost import measure_model_cost
from plans.resolve import resolve_plan
from plans.spec import PlanSpec, Precision, TrainSpec
from plans.workload import Workload
from workloads.corpus import CorpusSource
from workloads.gpt import TP_LAYER_SPECS
from workloads.objectives import CausalLM

REPO = Path(__file__).resolve().parents[1]

# (name, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU)
CONFIGS = [
    ("18.4B (Table 1)", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B (Table 1)", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B (Table 1)", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B (Table 1)", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("GPT-3 175B (sec. 5.1)", 96, 12288, 96, 8, 16, 1024, 1536, 140),
]
SEQ, VOCAB = 2048, 51200


def lm_inputs(seq_len: int) -> Workload:
    """Windows of ``seq_len`` tokens and next-token cross-entropy: what the GPT is counted on."""
    return Workload(model_factory=lambda: None, objective=CausalLM(), data=CorpusSource(seq_len=seq_len))


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """The paper's FLOPs per iteration (its equation 3, with activation recomputation)."""
    s, h, v, l_ = SEQ, hidden, VOCAB, layers
    return 96 * batch * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    register_configs()
    with initialize_config_module("orchestrator.conf", version_base="1.3"):
        typed, _, _ = to_typed(compose("config", overrides=["cluster=a100_8x"]))
    speeds = Speeds.declared(typed.cluster)
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, published in CONFIGS:
        cluster = type(typed.cluster)(**{**typed.cluster.__dict__, "nodes": gpus // 8})
        model_cfg = {"_target_": "workloads.gpt.GPT", "n_layer": layers, "d_model": hidden, "n_head": heads,
                     "seq_len": SEQ, "vocab_size": VOCAB, "tp": 1}
        probe = ModelProbe(model_factory(model_cfg), lm_inputs(SEQ), tp_layer_specs=TP_LAYER_SPECS)
        cost = measure_model_cost(probe, [tp])
        dp = gpus // (tp * pp)
        plan = resolve_plan(PlanSpec(dp=dp, tp=tp, pp=pp, zero_stage=0, activation_checkpointing=True,
                                     micro_batch_size=1, grad_accum_steps=batch // dp, precision=Precision.bf16),
                            cluster, TrainSpec(global_batch_size=batch))
        step = predict_step(plan, cost, speeds, devices_per_node=8, optim=typed.optim)
        paper_tflops = megatron_flops(batch, layers, hidden) / step.total_s / gpus / 1e12
        parts = step.as_dict()["parts_s"]
        rows.append((name, f"tp={tp} pp={pp} dp={dp}", gpus, batch, published, paper_tflops,
                     step.tflops_per_device, step.total_s,
                     ", ".join(f"{k} {v / step.total_s:.0%}" for k, v in parts.items() if v / step.total_s >= 0.005)))
        print(rows[-1], flush=True)
    lines = [f"Cost model vs Megatron-LM (SC'21), {datetime.date.today()}; `python -m bench.megatron_sanity`", "",
             "Declared speeds (`cluster=a100_8x`): 312 TFLOP/s bf16 peak derated to 80% sustained, NVLink 2400 Gb/s, "
             "InfiniBand 200 Gb/s per GPU. bf16, micro-batch 1, activation checkpointing, ZeRO-0.", "",
             "| model | plan | GPUs | batch | published TFLOP/s/GPU | predicted (paper's FLOPs formula) | "
             "predicted (counted FLOPs) | predicted step (s) | where the step goes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, plan, gpus, batch, published, paper, counted, step_s, parts in rows:
        lines.append(f"| {name} | {plan} | {gpus} | {batch} | {published} | {paper:.0f} ({paper / published:.2f}x) | "
                     f"{counted:.0f} | {step_s:.1f} | {parts} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
