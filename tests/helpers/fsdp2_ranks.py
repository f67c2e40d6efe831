"""Ranks of an FSDP2 engine run started by ``torch.multiprocessing`` with gloo on CPU (no Ray, no
worker loop): jobs built from the real :class:`orch.launchers.job.TrainJob`, the run's optimizer
settings and the workloads' own models and objectives; each scenario writes what it found as JSON
for the test to check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
SEQ = 16


def gpt():
    from orch.workloads.gpt import GPT

    return GPT(n_layer=2, d_model=32, n_head=2, seq_len=SEQ, vocab_size=256)


def llama():
    from orch.workloads.hf import hf_causal_lm

    return hf_causal_lm(LLAMA)


def llama_tied():
    """The same decoder with its ``lm_head`` sharing the token embedding's weight."""
    from orch.workloads.hf import hf_causal_lm

    return hf_causal_lm({**LLAMA, "tie_word_embeddings": True})


def vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


MODELS = {"gpt": gpt, "llama": llama, "llama_tied": llama_tied, "vit": vit}


def make_job(model: str, *, world: int, tp: int = 1, precision: str = "bf16", accum: int = 1, steps: int = 8,
             checkpointing: bool = False, hybrid: bool = False, reshard: bool = True, offload: bool = False,
             compile: bool = False, sequence_parallel: bool = False, async_tp: bool = False,
             fp8_recipe: str = "tensorwise"):
    """A :class:`TrainJob` as the driver builds one, for ``plan.engine=fsdp2`` on CPU workers."""
    from orch.launchers.job import TrainJob
    from orch.plans.model.workload import Workload
    from orch.plans.optim_settings import optim_settings
    from orch.plans.parallel.tp_plan import specs_from_tp_plan
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.spec import Accelerator, FSDPSpec, Offload, OptimSpec, Precision, TrainSpec
    from orch.workloads.corpus import CorpusSource
    from orch.workloads.objectives import CausalLM, Classification

    offloaded = Offload.cpu if offload else Offload.none
    plan = ResolvedPlan(dp=world // tp, tp=tp, pp=1, world_size=world, zero_stage=3, offload_optimizer=offloaded,
                        offload_param=offloaded, nvme_path=None, activation_checkpointing=checkpointing,
                        micro_batch_size=2, grad_accum_steps=accum, precision=Precision(precision),
                        accelerator=Accelerator.cpu, engine="fsdp2",
                        fsdp=FSDPSpec(hybrid=hybrid, reshard_after_forward=reshard), compile=compile,
                        sequence_parallel=sequence_parallel, async_tp=async_tp, fp8_recipe=fp8_recipe)
    from orch.workloads.gpt import TP_LAYER_SPECS

    if model.startswith("llama"):
        specs = specs_from_tp_plan(llama())
    elif model == "gpt":
        specs = TP_LAYER_SPECS
    else:
        specs = None
    optim = OptimSpec(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1)
    objective = Classification() if model == "vit" else CausalLM()
    workload = Workload(model_factory=MODELS[model], objective=objective, data=CorpusSource(seq_len=SEQ),
                        tp_layer_specs=specs)
    return TrainJob(plan=plan, optim=optim_settings(plan, optim, steps), workload=workload,
                    train=TrainSpec(steps=steps, seed=7))


def batch(model: str, index: int):
    """Micro-batch ``index`` (the same on every rank: what a dp rank reads does not matter here)."""
    g = torch.Generator().manual_seed(index)
    if model == "vit":
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def batches(model: str):
    """Two micro-batches, repeated: a run that learns memorizes them and its loss falls."""
    index = 0
    while True:
        yield batch(model, index % 2)
        index += 1


def spawn(scenario: str, world: int, out: Path, port: int, **kwargs) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(scenario, world, str(out), port, kwargs), nprocs=world, join=True)


def _rank(rank: int, scenario: str, world: int, out: str, port: int, kwargs: dict) -> None:
    # ``node_size``: workers per node the run is told it has (hybrid sharding's shard dimension).
    local = kwargs.pop("node_size", world)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local)})
    torch.set_num_threads(1)
    try:
        found = SCENARIOS[scenario](rank, world, Path(out), **kwargs)
        if rank == 0:
            (Path(out) / f"{scenario}.json").write_text(json.dumps(found))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    finally:
        # Leave the process group before exiting: a rank that exits with gloo's threads still
        # joinable can abort ("terminate called without an active exception"), which mp.spawn
        # reports as a failed rank after the scenario's work was done.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _engine(job, rank: int, world: int):
    from orch.launchers.engines import engine_for
    from orch.plans.parallel.rank_layout import parallel_coords

    engine = engine_for("fsdp2")
    engine.start(job, "127.0.0.1", int(os.environ["MASTER_PORT"]))
    built = engine.build(job, parallel_coords(rank, world, job.plan.tp))
    return engine, built


def _shapes(state: dict) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in state.items()}


def _clipped_norms(engine, job, model: str) -> list[float]:
    """The gradient norm of a large loss before and after the engine clips it to 0.5 (its gradients
    are then dropped): the scaling must bring DTensors of every mesh to the same global norm."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from orch.launchers.engines.fsdp2.engine import clip_grad_norm

    # Logits split over the vocabulary take their loss, and its backward, inside loss_parallel.
    with loss_parallel() if engine.split_head else contextlib.nullcontext():
        (job.workload.loss(engine.model, batch(model, 0)) * 1e3).backward()
    before = clip_grad_norm(engine.model.parameters(), 0.5)
    after = clip_grad_norm(engine.model.parameters(), 1e9)
    engine.optimizer.zero_grad(set_to_none=True)
    return [before, after]


def train_and_save(rank: int, world: int, out: Path, *, model: str, tp: int = 1, steps: int = 6,
                   checkpointing: bool = False, accum: int = 2, precision: str = "bf16", check_clip: bool = False,
                   **plan: bool) -> dict:
    """Train ``steps`` steps, save and publish a checkpoint, and consolidate the weights (``plan``:
    :func:`make_job`'s hybrid, reshard and offload); with ``check_clip``, clip a large gradient
    (:func:`_clipped_norms`) before saving."""
    from orch.launchers.checkpoint import publish, tag_for

    job = make_job(model, world=world, tp=tp, accum=accum, steps=steps + 4, checkpointing=checkpointing,
                   precision=precision, **plan)
    engine, built = _engine(job, rank, world)
    source = batches(model)
    losses, lrs = [], []
    for _ in range(steps):
        losses.append(engine.train_step(source, lambda phase="": None))
        lrs.append(engine.lr())
    clipped = _clipped_norms(engine, job, model) if check_clip else None
    evaluation = engine.evaluate(iter([batch(model, 0)]), 1)
    root = out / "checkpoints"
    engine.save(str(root), tag_for(steps), {"step": steps, "rng": torch.get_rng_state(), "layout": {"dp": world // tp}})
    torch.distributed.barrier()
    if rank == 0:
        publish(root, steps, None, keep=2)
    torch.distributed.barrier()
    full = engine.consolidated_state()
    found = {"losses": losses, "lrs": lrs, "eval": evaluation, "built": built.built, "optimizer": built.optimizer,
             "params_at_build": built.params_at_build, "params_on_rank": built.params_on_rank, "clipped": clipped}
    if rank == 0:
        torch.manual_seed(job.train.seed)
        whole = MODELS[model]()
        found["whole_shapes"], found["consolidated_shapes"] = _shapes(whole.state_dict()), _shapes(full)
        if "lm_head.weight" in full and "model.embed_tokens.weight" in full:
            # Trained apart, they would differ now.
            found["head_is_embedding"] = bool(torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"]))
        # The unsharded model, built from the same seed, on the first step's micro-batches: the
        # sharded run's first loss must be the same model's.
        with torch.no_grad():
            found["whole_first_loss"] = sum(float(job.workload.loss(whole, batch(model, i)))
                                            for i in range(accum)) / accum
        torch.save(full, out / "consolidated.pt")
        torch.save(torch.get_rng_state(), out / "rng.pt")
    torch.distributed.barrier()  # no rank leaves the group while another still works in it
    engine.shutdown()
    return found


def resume(rank: int, world: int, out: Path, *, model: str, steps: int = 6, precision: str = "bf16") -> dict:
    """Load the checkpoint ``train_and_save`` wrote (at another dp or tp), then train one step more."""
    from orch.launchers.checkpoint import tag_for

    job = make_job(model, world=world, accum=2, steps=steps + 4, precision=precision)
    engine, _ = _engine(job, rank, world)
    state = engine.load(str(out / "checkpoints"), tag_for(steps))
    evaluation = engine.evaluate(iter([batch(model, 0)]), 1)
    full = engine.consolidated_state()
    saved = torch.load(out / "consolidated.pt", weights_only=True)
    found = {"step": state["step"], "layout": state["layout"], "eval": evaluation, "lr": engine.lr(),
             "rng_equal": bool(torch.equal(state["rng"], torch.load(out / "rng.pt", weights_only=True)))}
    if rank == 0:
        found["weights_equal"] = sorted(full) == sorted(saved) and all(
            torch.equal(full[name], saved[name]) for name in saved)
    found["next_loss"] = engine.train_step(batches(model), lambda phase="": None)
    torch.distributed.barrier()  # no rank leaves the group while another still works in it
    engine.shutdown()
    return found


def refuse(rank: int, world: int, out: Path, *, model: str, tag: str, roots: list[str]) -> dict:
    """Try to load tag ``tag`` from each of ``roots`` (tampered copies); report each refusal."""
    job = make_job(model, world=world)
    engine, _ = _engine(job, rank, world)
    found = {}
    for root in roots:
        try:
            engine.load(root, tag)
            found[root] = {"refused": None}
        except Exception as error:  # the test checks which error, and its message
            found[root] = {"refused": type(error).__name__, "message": str(error)}
    torch.distributed.barrier()  # no rank leaves the group while another still works in it
    engine.shutdown()
    return found


def async_tp(rank: int, world: int, out: Path, *, overlapped: bool, steps: int = 4) -> dict:
    """The Llama at tp=2 with sequence parallelism: eager, or (``overlapped``) with each block
    compiled and ``plan.async_tp``. Symmetric memory is CUDA's, so the fused ops the compiler puts
    in run here as torch's own fallbacks (the collective, then the matmul: the fused kernels'
    arithmetic without the overlap), registered for CPU and counted, and the engine's CUDA-only
    set-up is replaced by the one switch it sets for the compiler."""
    from collections import Counter

    import torch._inductor.config
    import torch.distributed._symmetric_memory as symm_mem

    from orch.launchers.engines.fsdp2 import layout

    calls: Counter = Counter()

    def on_cpu(name, fallback):
        def run(*args, **kwargs):
            calls[name] += 1
            return fallback(*args, **kwargs)
        torch.library.impl(f"symm_mem::{name}", "CPU")(run)

    on_cpu("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback)
    on_cpu("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback)
    layout.enable_async_tp = lambda tp_mesh: setattr(torch._inductor.config, "_micro_pipeline_tp", True)
    job = make_job("llama", world=world, tp=world, precision="fp32", accum=1, steps=steps + 4,
                   compile=overlapped, sequence_parallel=True, async_tp=overlapped)
    with symm_mem._test_mode():
        engine, built = _engine(job, rank, world)
        source = batches("llama")
        losses = [engine.train_step(source, lambda phase="": None) for _ in range(steps)]
    torch.distributed.barrier()
    engine.shutdown()
    return {"losses": losses, "built": built.built, "calls": dict(calls)}


def fp8(rank: int, world: int, out: Path, *, model: str, precision: str, tp: int = 1, recipe: str = "tensorwise",
        steps: int = 6) -> dict:
    """``model`` trained in ``precision`` (bf16, or fp8 with ``recipe`` scaling). A CPU has no FP8
    tensor cores, but torch runs its scaled matmul there, so torchao's float8 training runs as on a
    GPU, slowly: the engine's GPU check is the one part replaced."""
    from orch.launchers.engines.fsdp2 import float8

    float8.fp8_device_problem = lambda device: None
    job = make_job(model, world=world, tp=tp, precision=precision, accum=1, steps=steps + 4, fp8_recipe=recipe)
    engine, built = _engine(job, rank, world)
    source = batches(model)
    losses = [engine.train_step(source, lambda phase="": None) for _ in range(steps)]
    kinds = sorted({type(m).__name__ for m in engine.model.modules() if isinstance(m, torch.nn.Linear)})
    state = engine.consolidated_state()
    torch.distributed.barrier()
    engine.shutdown()
    return {"losses": losses, "built": built.built, "linear_kinds": kinds, "keys": sorted(state or {})}


SCENARIOS = {"train_and_save": train_and_save, "resume": resume, "refuse": refuse, "async_tp": async_tp, "fp8": fp8}

