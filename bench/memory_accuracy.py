"""Planner accuracy: predicted vs measured per-device memory over a matrix of real runs.

Every plan of ZeRO 0-3 x optimizer offload on/off x activation checkpointing on/off that
DeepSpeed accepts (offload needs ZeRO >= 1: 14 plans) trains for a few steps with 2 workers
in Ray actors, in fp32; a few bf16 plans follow, then tensor- and pipeline-parallel plans
(tp=2, pp=2, and tp=2 x pp=2 on 4 workers), compared rank by rank: every pipeline stage
against the planner's row for that stage. Last, the shipped experiments' workloads other than the
built-in GPT: a Llama-shaped Hugging Face causal LM on tokenized text, a torchvision ViT under
ZeRO-3 and ResNet-50, in bf16, each also with activation checkpointing; the FSDP2 engine on
the built-in GPT, an HF Llama shape and the ViT recipe (``--plans fsdp2``); and selective
recomputation on both engines (``--plans recompute``); the FSDP2 engine's pipeline schedules
(``--plans pipeline``); sequence parallelism on an HF Llama shape (``--plans sequence``); context
parallelism on the built-in GPT and the HF Llama shape (``--plans context``); the output head split
over the vocabulary (``--plans head``). Each worker measures
its real peak tensor bytes during ``train.memory_probe_step`` and the tensor bytes it holds after that step
(orch/launchers/memory_probe.py). The MLflow run of each plan holds both next to the prediction. The
table compares the most loaded rank against the planner's prediction for it.

What is compared, and why:

* On CPU workers the "device" and the host are the same RAM of one process, so the worker's
  tensor bytes include the states the plan offloads to the host. The prediction compared is
  therefore the device figure plus the rank's host bytes (``PlanEstimate.host_per_device``).
* The worker also holds tensors that are not the model's: the data source's own (the corpus as
  one uint8 tensor, decoded images) and the last micro-batch. The planner does not predict them;
  each worker measures the tensor bytes opening its data source added (``data_tensor_bytes``),
  the micro-batch's bytes come from the data source's example batch, and both are shown in their
  own column and subtracted from both measured figures before the error is taken.

Targets: every plan's peak within ±10%, held model states within ±3%.

    python -m bench.memory_accuracy [--markdown bench/results/memory_accuracy.md] [overrides...]
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
import torch
from hydra import compose, initialize_config_module

from bench.harness import publish
from orch.config import register_configs, to_typed
from orch.launchers.ray_session import start_local_ray
from orch.plans.model.workload import batch_bytes, move_batch
from orch.run.driver import run_training
from orch.workload import resolve_workload

REPO = Path(__file__).resolve().parents[1]

# Big enough that model states dominate the process's incidental tensors (the corpus, RNG state).
MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.seq_len=128"]
RUN = ["train.steps=3", "train.log_every=3", "train.memory_probe_step=2", "train.eval_batches=1",
       "plan.micro_batch_size=8"]
PEAK_TARGET, HELD_TARGET = 0.10, 0.03
# Mixed precision changes every byte count (bf16 parameters and gradients, an fp32 master);
# one plan per memory layout family is enough to check it.
BF16_PLANS = [
    ["plan.zero_stage=0", "plan.precision=bf16"],
    ["plan.zero_stage=2", "plan.precision=bf16"],
    ["plan.zero_stage=3", "plan.precision=bf16", "plan.activation_checkpointing=true"],
]


# Tensor and pipeline parallelism; 4-worker plans run half a CPU per worker on this machine.
FOUR_WORKERS = ["cluster.devices_per_node=4", "cluster.cpus_per_worker=0.5"]
PARALLEL_PLANS = [
    ["plan.dp=1", "plan.tp=2"],
    ["plan.dp=1", "plan.tp=2", "plan.zero_stage=2"],
    ["plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2"],
    ["plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=4", "plan.zero_stage=1"],
    ["plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2", "plan.activation_checkpointing=true"],
    ["plan.dp=1", "plan.tp=2", "plan.pp=2", "plan.grad_accum_steps=2", *FOUR_WORKERS],
]


# The experiments' models and data, as they ship (experiment files only hold overrides).
WORKLOAD_PLANS = [
    [f"experiment={name}", *extra]
    for name in ("llama_text", "vit_zero3_bf16", "resnet50_bf16")
    for extra in ([], ["plan.activation_checkpointing=true"])
]


# The FSDP2 engine (plan.engine=fsdp2): the built-in GPT, an HF Llama shape and the ViT recipe,
# with and without resharding after forward, checkpointing and accumulation.
FSDP2 = ["plan.engine=fsdp2", "plan.zero_stage=0"]
FSDP2_PLANS = [
    [*FSDP2, "plan.precision=bf16"],
    [*FSDP2, "plan.precision=fp32"],
    [*FSDP2, "plan.precision=bf16", "plan.activation_checkpointing=true"],
    [*FSDP2, "plan.precision=bf16", "plan.fsdp.reshard_after_forward=false"],
    [*FSDP2, "plan.precision=bf16", "plan.grad_accum_steps=2"],
    ["model=hf_causal_lm", *FSDP2, "plan.precision=bf16"],
    ["model=hf_causal_lm", *FSDP2, "plan.precision=bf16", "plan.activation_checkpointing=true"],
    ["experiment=vit_fsdp_bf16"],
    ["experiment=vit_fsdp_bf16", "plan.activation_checkpointing=true"],
]


# Selective recomputation (matmul and attention outputs kept, the rest recomputed) on each engine
# and memory layout: DeepSpeed's ZeRO stages and its pipeline, FSDP2 on the GPT, an HF Llama shape
# (through its own switch) and the ViT recipe.
SELECTIVE = "plan.activation_checkpointing=selective"
RECOMPUTE_PLANS = [
    *([f"plan.zero_stage={stage}", SELECTIVE] for stage in range(4)),
    ["plan.zero_stage=3", "plan.precision=bf16", SELECTIVE],
    ["plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=2", SELECTIVE],
    [*FSDP2, "plan.precision=bf16", SELECTIVE],
    ["model=hf_causal_lm", *FSDP2, "plan.precision=bf16", SELECTIVE],
    ["experiment=vit_fsdp_bf16", SELECTIVE],
]


PIPE = ["plan.engine=fsdp2", "plan.zero_stage=0", "plan.pp=2"]
PIPELINE_PLANS = [
    [*PIPE, "plan.dp=1", "plan.grad_accum_steps=2"],
    [*PIPE, "plan.dp=1", "plan.grad_accum_steps=4", "plan.pp_schedule=gpipe"],
    [*PIPE, "plan.dp=1", "plan.grad_accum_steps=4", "plan.pp_schedule=interleaved_1f1b", "plan.pp_virtual_stages=2"],
    [*PIPE, "plan.dp=1", "plan.grad_accum_steps=4", "plan.pp_schedule=zbv", "plan.pp_virtual_stages=2",
     "plan.fsdp.reshard_after_forward=false"],
    # The zero-bubble schedules' later ranks defer weight backwards into the drain, holding their
    # output gradients and activations.
    *(["model.n_layer=8", "plan.engine=fsdp2", "plan.zero_stage=0", "plan.pp=4", "plan.dp=1", "plan.grad_accum_steps=8",
       f"plan.pp_schedule={schedule}", "plan.pp_virtual_stages=2", "plan.fsdp.reshard_after_forward=false",
       *FOUR_WORKERS] for schedule in ("zbv", "zero_bubble")),
    [*PIPE, "plan.dp=1", "plan.grad_accum_steps=2", "plan.activation_checkpointing=full"],
    [*PIPE, "plan.dp=2", "plan.grad_accum_steps=2", *FOUR_WORKERS],
]
"""The fsdp2 engine's pipeline stages: each schedule, recomputation, and data parallel across stages."""


SPLIT = ["model=hf_causal_lm", "plan.engine=fsdp2", "plan.zero_stage=0", "plan.dp=1", "plan.tp=2"]
SEQUENCE_PLANS = [
    [*SPLIT, "plan.precision=fp32", "plan.sequence_parallel=false"],
    [*SPLIT, "plan.precision=fp32", "plan.sequence_parallel=true"],
    [*SPLIT, "plan.precision=bf16", "plan.sequence_parallel=true"],
    [*SPLIT, "plan.precision=bf16", "plan.sequence_parallel=true", SELECTIVE],
    [*SPLIT, "plan.precision=bf16", "plan.sequence_parallel=false", "plan.activation_checkpointing=full"],
    [*SPLIT, "plan.precision=bf16", "plan.sequence_parallel=true", "plan.activation_checkpointing=full"],
]
"""Sequence parallelism on an HF Llama shape at tp=2, beside tensor parallelism alone."""

CONTEXT = ["plan.engine=fsdp2", "plan.zero_stage=0", "plan.dp=1", "plan.cp=2"]
CONTEXT_PLANS = [
    [*CONTEXT, "plan.precision=fp32"],
    [*CONTEXT, "plan.precision=bf16", "plan.activation_checkpointing=full"],
    [*CONTEXT, "model=hf_causal_lm", "plan.precision=fp32"],
    [*CONTEXT, "model=hf_causal_lm", "plan.precision=bf16"],
    [*CONTEXT, "model=hf_causal_lm", "plan.precision=bf16", SELECTIVE],
    [*CONTEXT, "model=hf_causal_lm", "plan.precision=bf16", "plan.activation_checkpointing=full"],
    [*CONTEXT, "plan.pp=2", "plan.grad_accum_steps=2", "plan.precision=fp32", *FOUR_WORKERS],
    [*CONTEXT, "model=hf_causal_lm", "plan.pp=2", "plan.grad_accum_steps=2", "plan.precision=bf16", *FOUR_WORKERS],
]
"""Context parallelism at cp=2: the built-in GPT and an HF Llama shape (grouped-query attention),
alone and in pipeline stages (cp=2 x pp=2 on 4 workers)."""

HEAD = ["model=hf_causal_lm", "model.config.tie_word_embeddings=false", "model.config.vocab_size=8192",
        "plan.engine=fsdp2", "plan.zero_stage=0", "plan.tp=2"]
TIED_HEAD = ["model.vocab_size=8192", "plan.engine=fsdp2", "plan.zero_stage=0", "plan.tp=2", "plan.dp=1"]
HEAD_PLANS = [
    [*HEAD, "plan.dp=1", "plan.precision=fp32", "plan.loss_parallel=false"],
    [*HEAD, "plan.dp=1", "plan.precision=fp32"],
    [*HEAD, "plan.dp=1", "plan.precision=bf16", "plan.sequence_parallel=true"],
    [*HEAD, "plan.dp=1", "plan.precision=bf16", "plan.sequence_parallel=true", "plan.activation_checkpointing=full"],
    [*HEAD, "plan.dp=1", "plan.pp=2", "plan.precision=fp32", "plan.grad_accum_steps=2", *FOUR_WORKERS],
    [*TIED_HEAD, "plan.precision=fp32", "plan.loss_parallel=false"],
    [*TIED_HEAD, "plan.precision=fp32"],
    [*TIED_HEAD, "plan.precision=bf16", "plan.sequence_parallel=true"],
    [*TIED_HEAD, "plan.pp=2", "plan.precision=fp32", "plan.grad_accum_steps=2", *FOUR_WORKERS],
]
"""The output head split over the vocabulary (``plan.loss_parallel``) on an untied HF Llama shape
whose vocabulary of 8192 makes the head a third of the parameters: at tp=2 beside the whole head,
with sequence parallelism and recomputation, and on the last stage of tp=2 x pp=2; and the built-in
GPT's tied head at a vocabulary of 8192, split with its token embedding, alone and at tp=2 x pp=2
(a copy of the embedding split on each end stage)."""


HEAD_NOTE = """
The split loss's temporaries are made in DTensor's Python op handlers (torch's `loss_parallel`),
which the worker's tensor tracker runs with itself pushed again; `python -m bench.split_loss_memory`
measures that loss alone by the resident set as well (bench/results/split_loss_memory.md).
"""


def plans(which: str = "all") -> list[list[str]]:
    if which == "recompute":
        return RECOMPUTE_PLANS
    if which == "pipeline":
        return PIPELINE_PLANS
    if which == "sequence":
        return SEQUENCE_PLANS
    if which == "context":
        return CONTEXT_PLANS
    if which == "head":
        return HEAD_PLANS
    if which == "parallel":
        return PARALLEL_PLANS
    if which == "workloads":
        return WORKLOAD_PLANS
    if which == "fsdp2":
        return FSDP2_PLANS
    matrix = []
    for stage, offload, ckpt in itertools.product(range(4), ("none", "cpu"), (False, True)):
        if stage == 0 and offload != "none":
            continue
        matrix.append([f"plan.zero_stage={stage}", f"plan.offload_optimizer={offload}",
                       f"plan.activation_checkpointing={str(ckpt).lower()}"])
    return (matrix + BF16_PLANS + PARALLEL_PLANS + WORKLOAD_PLANS + FSDP2_PLANS + RECOMPUTE_PLANS + PIPELINE_PLANS
            + SEQUENCE_PLANS + CONTEXT_PLANS + HEAD_PLANS)


def micro_batch_bytes(workload, micro_batch_size: int, precision: str) -> int:
    """One micro-batch as the worker holds it: the data source's batch, floating-point tensors
    in the training precision (the worker casts them)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return batch_bytes(move_batch(workload.example_batch(micro_batch_size), "meta", dtype))


def measure(overrides: list[str], tracking_uri: str) -> list[dict]:
    """One row for the plan, or one per pipeline stage: the most loaded rank of each against
    the planner's prediction for it."""
    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        # The built-in GPT's sizes, unless the plan is an experiment with a model of its own.
        model = [] if any(o.startswith(("experiment=", "model=")) for o in overrides) else MODEL
        cfg = compose("config", overrides=[*model, *RUN, f"tracking.uri={tracking_uri}",
                                           "tracking.experiment=memory-accuracy", *overrides])
    run_cfg, model_cfg, config_yaml = to_typed(cfg)
    result = run_training(run_cfg, model_cfg, config_yaml)
    workload = resolve_workload(model_cfg, run_cfg.objective, run_cfg.data)
    last = result.reports[-1]
    estimate = result.estimate
    stage_of = {f.rank: f.pp_rank for f in result.worker_facts}
    data_bytes = {f.rank: f.data_tensor_bytes for f in result.worker_facts}
    batch = micro_batch_bytes(workload, estimate.plan.micro_batch_size, estimate.plan.precision.value)
    name = " ".join(o.split(".", 1)[1] if o.startswith("plan.") else o
                    for o in overrides if not o.startswith("cluster."))
    rows = []
    # On GPUs the measured figures are CUDA's allocator (device tensors only): no host-side states,
    # no data tensors (they stay in host memory), and the planner's allocator reserve left out.
    gpu = estimate.plan.accelerator.value == "gpu"
    host = 0 if gpu else estimate.host_per_device
    if gpu:
        data_bytes = dict.fromkeys(data_bytes, 0)
    for stage, device in enumerate(estimate.stages):
        ranks = [r for r in last if stage_of[r.rank] == stage]
        # The most loaded rank by what is compared: measured minus the rank's own non-model bytes.
        peak_rank = max(ranks, key=lambda r: r.measured_peak_bytes - data_bytes[r.rank])
        held_rank = max(ranks, key=lambda r: r.measured_state_bytes - data_bytes[r.rank])
        reserve = device.reserve if gpu else 0
        rows.append({
            "plan": name + (f" (stage {stage})" if len(estimate.stages) > 1 else ""),
            "phase": device.phase,
            "predicted_peak": device.total - reserve + host,
            "measured_peak": peak_rank.measured_peak_bytes - data_bytes[peak_rank.rank],
            "predicted_held": device.held + host,
            "measured_held": held_rank.measured_state_bytes - data_bytes[held_rank.rank],
            "non_model": batch,
            "data": max(data_bytes[r.rank] for r in ranks),
            "run_id": result.run_id,
        })
    return rows


def measure_with_retry(overrides: list[str], tracking_uri: str, attempts: int = 3) -> list[dict]:
    """:func:`measure`, again when Ray lost the workers to the machine (the OOM killer on a shared host).

    A plan that fails for its own reasons fails the same way every time, so it still ends the run.
    """
    for _ in range(attempts - 1):
        try:
            return measure(overrides, tracking_uri)
        except ray.exceptions.RayError as e:
            print(f"retrying {' '.join(overrides)} after: {type(e).__name__}", file=sys.stderr, flush=True)
    return measure(overrides, tracking_uri)


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def within_target(row: dict) -> bool:
    peak = error(row["predicted_peak"], row["measured_peak"] - row["non_model"])
    held = error(row["predicted_held"], row["measured_held"] - row["non_model"])
    return abs(peak) <= PEAK_TARGET and abs(held) <= HELD_TARGET


def table(rows: list[dict]) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f}"

    lines = ["| plan | peak phase | predicted peak MiB | measured peak MiB | error | predicted held MiB | "
             "measured held MiB | error | non-model MiB | in target |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        peak = r["measured_peak"] - r["non_model"]
        held = r["measured_held"] - r["non_model"]
        lines.append(f"| {r['plan']} | {r['phase']} | {mib(r['predicted_peak'])} | {mib(peak)} | "
                     f"{100 * error(r['predicted_peak'], peak):+.1f}% | {mib(r['predicted_held'])} | {mib(held)} | "
                     f"{100 * error(r['predicted_held'], held):+.1f}% | {mib(r['non_model'] + r['data'])} | "
                     f"{'yes' if within_target(r) else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--plans", choices=("all", "parallel", "workloads", "fsdp2", "recompute", "pipeline",
                                                 "sequence", "context", "head"),
                        default="all",
                        help="all plans, only the tensor- and pipeline-parallel ones, only the experiments', "
                             "only the FSDP2 engine's, only selective recomputation's, only the FSDP2 "
                             "engine's pipeline schedules, sequence or context parallelism, or the "
                             "vocabulary-parallel head")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every plan")
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="orch-bench-")
    # A Ray of its own (even when another cluster runs on this machine), on loopback as `orch` starts it.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    start_local_ray(num_cpus=max(2, gpus), num_gpus=gpus, object_store_memory=300 * 2**20,
                    runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        # On GPUs, each worker needs a GPU of its own: the 4-worker plans need 4.
        chosen = [p for p in plans(args.plans) if not (gpus and gpus < 4 and FOUR_WORKERS[0] in p)]
        rows = [row for p in chosen
                for row in measure_with_retry([*p, *args.overrides], f"sqlite:///{store}/mlflow.db")]
    finally:
        ray.shutdown()
    hits = sum(within_target(r) for r in rows)
    models = ("the shipped experiments' models and data" if args.plans == "workloads"
              else f"model {' '.join(MODEL)} unless the plan names another")
    command = " ".join(["python -m bench.memory_accuracy", *(["--plans", args.plans] if args.plans != "all" else [])])
    text = (f"Planner accuracy, {datetime.date.today()}, {platform.machine()} {platform.processor() or ''}"
            f" 2 CPU workers, {models}, {' '.join(RUN[-1:])}; `{command}`\n\n"
            "Measured figures have the non-model tensors (the data source's and one micro-batch) subtracted; "
            "predictions "
            "include the rank's host-side states, which live in the same process on CPU workers.\n\n"
            f"{table(rows)}\n\n"
            f"{hits} of {len(rows)} plans within target (peak ±{PEAK_TARGET:.0%}, held ±{HELD_TARGET:.0%}).\n"
            + (HEAD_NOTE if args.plans == "head" else ""))
    publish([text.rstrip("\n")], args.markdown)


if __name__ == "__main__":
    main()
