"""A plain DeepSpeed training script: what a user writes without an orchestrator.

It is the baseline the benchmarks run `orch train` against, launched by ``torchrun`` (one
process per rank, rendezvous through the environment) or by Ray Train's ``TorchTrainer``
(:func:`train_loop_per_worker`). Its loop does the work `orch`'s worker does per step: the
same model, DeepSpeed config, data shards, loss, logging all-reduce and final evaluation.
No orchestration around it: no tracking, no progress polling, no memory probe, no checkpoints.

    torchrun --nproc-per-node 2 bench/plain_deepspeed.py --job job.json

``job.json`` comes from :func:`run_spec.plain_job`. Rank 0 prints ``step N/T loss L
step_time S t=<unix time>`` for every logged step; other ranks print their own step time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time


def _unlink_shared_memory_buffers() -> None:
    """DeepSpeed's CPU backend leaves a 67 MB /dev/shm buffer per rank; remove this run's once all ranks map them."""
    import deepspeed.comm as dist

    dist.barrier()
    pattern = f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_*"
    for path in glob.glob(pattern):
        try:
            os.unlink(path)
        except FileNotFoundError:  # a peer removed it first
            pass


def train(job: dict) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    import torch.nn.functional as F

    from orch.launchers.batches import ShardedBatches
    from orch.workloads.corpus import ByteWindows, load_bytes, split
    from orch.workloads.gpt import GPT

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    _unlink_shared_memory_buffers()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(job["seed"])
    module = GPT(**job["model"])
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=job["ds_config"])
    train_bytes, val_bytes = split(load_bytes(job["data_path"]), job["val_fraction"])
    batches = ShardedBatches(ByteWindows(train_bytes, job["seq_len"]), batch_size=job["micro_batch_size"],
                             dp_rank=rank, dp_size=job["dp"], seed=job["seed"])
    val_batches = ShardedBatches(ByteWindows(val_bytes, job["seq_len"]), batch_size=job["micro_batch_size"],
                                 dp_rank=rank, dp_size=job["dp"], seed=job["seed"], shuffle=False)

    def loss_of(batch):
        inputs, targets = (t.to(engine.device) for t in batch)
        logits = engine(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def mean_over_ranks(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / world_size

    steps, log_every = job["steps"], job["log_every"]
    interval_loss, interval_time, interval_steps = 0.0, 0.0, 0
    engine.train()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        step_loss = 0.0
        for _ in range(job["grad_accum_steps"]):
            loss = loss_of(next(batches))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item()
        interval_time += time.perf_counter() - started
        interval_loss += step_loss / job["grad_accum_steps"]
        interval_steps += 1
        last = step == steps
        if step % log_every and not last:
            continue
        global_loss = mean_over_ranks(interval_loss / interval_steps)
        lr = engine.get_lr()[0]
        step_time = interval_time / interval_steps
        line = f"step {step}/{steps} loss {global_loss:.4f} lr {lr:.3g} step_time {step_time:.6f}"
        if last:
            engine.eval()
            with torch.no_grad():
                total = sum(loss_of(next(val_batches)).item() for _ in range(job["eval_batches"]))
            engine.train()
            line += f" eval_loss {mean_over_ranks(total / job['eval_batches']):.4f}"
        if rank == 0:
            print(f"{line} t={time.time():.6f}", flush=True)
        else:
            print(f"rank {rank} at {step}/{steps} step_time {step_time:.6f}", flush=True)
        interval_loss, interval_time, interval_steps = 0.0, 0.0, 0
    if rank == 0:
        print(f"threads per rank: {torch.get_num_threads()}", flush=True)
    dist.destroy_process_group()


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's entry point: it has already joined the process group; DeepSpeed adopts it."""
    train(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job JSON written by run_spec.plain_job")
    args = parser.parse_args()
    with open(args.job) as f:
        train(json.load(f))
    # Every step is done and reported, and the process group destroyed. Leave without the C++
    # static teardown: there, torch's distributed backend now and then calls std::terminate
    # ("terminate called without an active exception", no Python frame left), which would fail a
    # finished run under torchrun.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
