"""One DeepSpeed training process, run inside a Ray actor.

The actor is created by :mod:`launchers.worker_group`; its ``train`` method is a Ray streaming
generator that yields one report per logged step, so the driver sees progress live and
notices a dead worker as soon as its stream breaks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Iterator

from launchers.job import TrainJob
from launchers.placement import RankSlot


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def enable_activation_checkpointing(module) -> None:
    """Turn on recomputation through the model's own switch (Hugging Face's name)."""
    switch = getattr(module, "gradient_checkpointing_enable", None)
    if switch is None:
        raise TypeError(f"{type(module).__name__} has no gradient_checkpointing_enable(); "
                        "it cannot run with plan.activation_checkpointing=true")
    switch()


class TrainWorker:
    """A DeepSpeed worker: one rank of the run."""

    def __init__(self):
        self.engine = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str, master_port: int) -> dict:
        """Join the process group and build the DeepSpeed engine; returns facts for the driver."""
        self.rank, self.world_size = slot.rank, world_size
        os.environ.update(job.env)
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(slot.rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_SIZE": str(slot.local_world_size), "LOCAL_WORLD_SIZE": str(slot.local_world_size),
        })
        import deepspeed
        import torch
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)  # progress is reported by the driver, not by every rank
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

        from workloads.corpus import ByteWindows, ShardedBatches, load_bytes, split

        self.job = job
        plan = job.plan
        backend = "gloo" if plan.accelerator.value == "cpu" else "nccl"
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        torch.manual_seed(job.train.seed)

        module = job.model_factory()
        if plan.activation_checkpointing:
            enable_activation_checkpointing(module)
        self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                    config=job.ds_config)
        train_bytes, val_bytes = split(load_bytes(job.data.path), job.data.val_fraction)
        dp_rank = self.rank  # pure data parallelism: every rank is its own dp replica
        self.batches = ShardedBatches(ByteWindows(train_bytes, job.data.seq_len), batch_size=plan.micro_batch_size,
                                      dp_rank=dp_rank, dp_size=plan.dp, seed=job.train.seed)
        self.val_batches = ShardedBatches(ByteWindows(val_bytes, job.data.seq_len), batch_size=plan.micro_batch_size,
                                          dp_rank=dp_rank, dp_size=plan.dp, seed=job.train.seed, shuffle=False)
        return {"rank": self.rank, "pid": os.getpid(), "hostname": socket.gethostname(), "dp_rank": dp_rank}

    def _loss(self, batch):
        import torch.nn.functional as F

        inputs, targets = (t.to(self.engine.device) for t in batch)
        logits = self.engine(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _mean_over_ranks(self, values: list[float]) -> list[float]:
        import deepspeed.comm as dist
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def evaluate(self) -> float:
        import torch

        self.engine.eval()
        total = 0.0
        with torch.no_grad():
            for _ in range(self.job.train.eval_batches):
                total += self._loss(next(self.val_batches)).item()
        self.engine.train()
        return self._mean_over_ranks([total / self.job.train.eval_batches])[0]

    def train(self) -> Iterator[dict]:
        """Run ``train.steps`` optimizer steps; yield a report every ``train.log_every`` steps.

        Step ``train.memory_probe_step`` runs under a :class:`PeakMemoryTracker`; from then on
        every report carries this rank's measured peak and post-step tensor bytes, which the
        planner's prediction is checked against. The tracker slows that one step down, and its
        time is part of the interval's ``step_time_s``.
        """
        from launchers.memory_probe import PeakMemoryTracker, live_tensor_bytes

        job, plan, spec = self.job, self.job.plan, self.job.train
        tokens_per_step = plan.micro_batch_size * plan.grad_accum_steps * job.data.seq_len
        first_batch_digest = None
        interval_loss, interval_time, interval_steps = 0.0, 0.0, 0
        measured: dict[str, int] = {}
        self.engine.train()
        for step in range(1, spec.steps + 1):
            started = time.perf_counter()
            step_loss = 0.0
            probe = PeakMemoryTracker() if step == spec.memory_probe_step else contextlib.nullcontext()
            with probe:
                for _ in range(plan.grad_accum_steps):
                    batch = next(self.batches)
                    if first_batch_digest is None:
                        first_batch_digest = hashlib.sha1(batch[0].numpy().tobytes()).hexdigest()
                    loss = self._loss(batch)
                    self.engine.backward(loss)
                    self.engine.step()
                    step_loss += loss.item()
            interval_time += time.perf_counter() - started
            if step == spec.memory_probe_step:
                measured = {"measured_peak_bytes": probe.peak, "measured_state_bytes": live_tensor_bytes()}
            interval_loss += step_loss / plan.grad_accum_steps
            interval_steps += 1
            last = step == spec.steps
            if step % spec.log_every and not last:
                continue
            local_loss = interval_loss / interval_steps
            global_loss, = self._mean_over_ranks([local_loss])
            report = {
                "rank": self.rank, "step": step, "loss": global_loss, "local_loss": local_loss,
                "lr": self.engine.get_lr()[0], "step_time_s": interval_time / interval_steps,
                "tokens_per_s": tokens_per_step * interval_steps / interval_time,
                "first_batch_digest": first_batch_digest, **measured,
            }
            if (spec.eval_every and step % spec.eval_every == 0) or last:
                report["eval_loss"] = self.evaluate()
            yield report
            interval_loss, interval_time, interval_steps = 0.0, 0.0, 0

    def start(self) -> None:
        """Run :meth:`train` on a thread of its own and return at once.

        The driver then calls :meth:`poll`, which the actor keeps answering while the step
        runs. Polling works through every way of reaching Ray, Ray Client (``ray://``) included,
        which streaming generators do not, and a poll that stops being answered tells the
        driver the process is gone.
        """
        self._reports: list[dict] = []
        self._done = False
        self._error: str | None = None
        device = getattr(self.engine, "device", None)

        def run() -> None:
            try:
                if device is not None and getattr(device, "type", "cpu") == "cuda":
                    import torch

                    torch.cuda.set_device(device)  # the current device is per thread
                for report in self.train():
                    self._reports.append(report)  # list.append is atomic under the GIL
            except BaseException:  # reported to the driver through poll(), never swallowed
                self._error = traceback.format_exc()
            finally:
                self._done = True

        self._thread = threading.Thread(target=run, name=f"train-rank{self.rank}", daemon=True)
        self._thread.start()

    def poll(self, seen: int) -> dict:
        """Reports after the first ``seen``, whether training ended, and its traceback if it failed."""
        return {"reports": self._reports[seen:], "done": self._done, "error": self._error}

    def shutdown(self) -> None:
        import deepspeed.comm as dist

        if dist.is_initialized():
            dist.destroy_process_group()
