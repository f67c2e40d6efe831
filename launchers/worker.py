"""One training process, run inside a Ray actor: the loop and the link to the driver.

The actor is created by :mod:`launchers.worker_group`. The engine (:mod:`launchers.engines`,
chosen by ``plan.engine``) owns the model, the optimizer and their checkpoint files; the worker
reads as the algorithm: set up, then for each step a batch, a step, a report and a checkpoint,
then finish. The driver calls :meth:`TrainWorker.start` and then polls: reports come back per
logged step, and a poll that stops being answered tells it the process is gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from launchers.checkpoint_io import CheckpointIO
from launchers.devices import DeviceMapping
from launchers.engines import Engine, engine_for
from launchers.gpu_worker import accelerator_ids, cuda_memory_facts, reset_cuda_peak, use_device
from launchers.job import PollStatus, StepReport, TrainJob, WorkerFacts
from launchers.lean_startup import collector_paused
from launchers.placement import RankSlot, parallel_coords
from launchers.rendezvous import AGENT_STORE_ENV, RendezvousHost
from launchers.worker_data import digest, rank_batches


def match_torch_threads() -> None:
    """Size torch's intra-op thread pool to ``OMP_NUM_THREADS``, which Ray sets to the actor's
    CPUs when the actor is placed.

    OpenMP reads the variable once, when torch is loaded: a process that imported torch before
    it was placed (a cluster whose Ray preloads modules into its idle workers,
    ``preload_python_modules``) would otherwise run one thread per core of the node in every
    rank, and ranks sharing a node would slow each other down.
    """
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit() or int(threads) < 1:
        return
    import torch

    if torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


class TrainWorker:
    """One rank of the run."""

    def __init__(self):
        with collector_paused():  # torch's import, which this module leaves to here: start-up
            import torch  # noqa: F401

            match_torch_threads()
        self.engine: Engine | None = None
        self.device_mapping: DeviceMapping | None = None
        self.start_step = 0
        self.progress_step = 0
        """The last optimizer step this rank finished (read by the driver's hang detection)."""
        self.milestones = 0
        """Forward, backward and step calls finished: when every rank stalls, the ones with
        the fewest are where the others wait for them."""

    def address(self) -> tuple[str, int]:
        """Where this actor, as rank 0, hosts the rendezvous: its node's IP and a port bound there."""
        import ray

        self.rendezvous = RendezvousHost(ray.util.get_node_ip_address())
        return self.rendezvous.address

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def accelerator_ids(self) -> tuple[str, list[str]]:
        """This actor's node and the GPU ids Ray gave it (:func:`launchers.gpu_worker.accelerator_ids`)."""
        return accelerator_ids()

    def use_devices(self, mapping: DeviceMapping) -> None:
        """Remember this rank's GPU mapping; :meth:`setup` applies it before the process group starts."""
        self.device_mapping = mapping

    def setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str,
              master_port: int, streams: tuple[Any, Any] | None = None) -> WorkerFacts:
        """Join the process group, build the engine and this rank's batches; returns facts for the driver.

        ``streams`` is this rank's ``(training, evaluation)`` pair of a streamed data source
        (:class:`plans.workload.StreamingSource`): given to the first rank of each data-parallel
        replica, which reads it for the replica's other ranks.
        """
        with collector_paused():  # imports and the engine: start-up (launchers.lean_startup)
            return self._setup(job, slot, world_size, master_addr, master_port, streams)

    def _setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str,
               master_port: int, streams: tuple[Any, Any] | None) -> WorkerFacts:
        import torch

        from launchers.matmul_probe import matmul_tflops

        self.job, self.rank, self.world_size, self.local_rank = job, slot.rank, world_size, slot.local_rank
        self._samples_node = slot.local_rank == 0 and job.system_metrics_interval_s > 0
        os.environ.update(job.env)
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(slot.rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_SIZE": str(slot.local_world_size), "LOCAL_WORLD_SIZE": str(slot.local_world_size),
            **AGENT_STORE_ENV,
        })
        if self.device_mapping is not None:
            use_device(self.device_mapping)
        self.engine = engine_for(job.plan.engine.value)
        self.engine.start(job, master_addr, master_port)
        torch.manual_seed(job.train.seed)
        coords = parallel_coords(self.rank, world_size, job.plan.tp, job.plan.pp)
        built = self.engine.build(job, coords)
        self.batches, self.val_batches, data_tensor_bytes = rank_batches(job, self.rank, coords, streams)
        self.checkpoints = CheckpointIO(job, self.rank, self.local_rank, world_size)
        self.start_step = self._resume(job.resume_tag) if job.resume_tag else 0
        self.first_batch_digest: str | None = None
        self.train_batches = self._recorded(self.batches)
        return WorkerFacts(rank=self.rank, pid=os.getpid(), hostname=socket.gethostname(), dp_rank=coords.dp_rank,
                           tp_rank=coords.tp_rank, pp_rank=coords.pp_rank, start_step=self.start_step,
                           params_on_rank=built.params_on_rank, params_at_build=built.params_at_build,
                           built=built.built, data_tensor_bytes=data_tensor_bytes,
                           optimizer_note=built.optimizer_note, optimizer=built.optimizer,
                           peak_tflops=matmul_tflops(job.plan.precision.value, self.engine.device),
                           torch_threads=torch.get_num_threads())

    def _recorded(self, batches):
        """The training batches, fingerprinting the first this rank reads (tests compare them)."""
        for batch in batches:
            if self.first_batch_digest is None:
                self.first_batch_digest = digest(batch)
            yield batch

    def _resume(self, tag: str) -> int:
        """Load the engine's state, then the data position and RNG; return the step."""
        import torch

        client_state = self.checkpoints.restore(self.engine, tag)
        data, val_data = client_state["data"], client_state["val_data"]
        saved = client_state.get("layout")
        plan = self.job.plan
        if saved and (saved["dp"], saved["micro_batch_size"]) != (plan.dp, plan.micro_batch_size):
            from launchers.checkpoint import resumed_position

            data = {**data, "position": resumed_position(data["position"], saved, plan.micro_batch_size, plan.dp)}
            val_data = {**val_data, "position": resumed_position(val_data["position"], saved,
                                                                 plan.micro_batch_size, plan.dp)}
        self.batches.load_state_dict(data)
        self.val_batches.load_state_dict(val_data)
        torch.set_rng_state(client_state["rng"])
        self.resumed_loss = float(client_state.get("loss", float("nan")))
        return int(client_state["step"])

    def _save(self, step: int, loss: float) -> None:
        """Checkpoint ``step``. ``loss`` is this rank's mean training loss over the steps since its
        last report: an attempt resumed from the last step's checkpoint has no step left to train,
        and reports it."""
        import torch

        from launchers.checkpoint import layout_of

        self.checkpoints.save(self.engine, step, {
            "step": step, "data": self.batches.state_dict(), "val_data": self.val_batches.state_dict(),
            "rng": torch.get_rng_state(), "layout": layout_of(self.job.plan), "loss": loss})

    def _mean_over_ranks(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        # On the engine's device: NCCL reduces device tensors only.
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def evaluate(self) -> dict[str, float]:
        """The held-out loss, and the objective's own metrics (``eval_<name>``), averaged over
        ``train.eval_batches`` batches and the ranks."""
        found = self.engine.evaluate(self.val_batches, self.job.train.eval_batches)
        names = sorted(found)
        means = self._mean_over_ranks([found[name] for name in names])
        return {f"eval_{name}": mean for name, mean in zip(names, means, strict=True)}

    def _milestone(self) -> None:
        self.milestones += 1

    def train(self) -> Iterator[StepReport]:
        """Run ``train.steps`` optimizer steps; yield a report every ``train.log_every`` steps.

        Step ``train.memory_probe_step`` runs under a :class:`PeakMemoryTracker`; from then on
        every report carries this rank's measured peak and post-step tensor bytes, which the
        planner's prediction is checked against. The tracker slows that one step down, and its
        time is part of the interval's ``step_time_s``.
        """
        from launchers.memory_probe import PeakMemoryTracker, live_tensor_bytes

        job, plan, spec = self.job, self.job.plan, self.job.train
        samples_per_step = plan.micro_batch_size * plan.grad_accum_steps
        tokens_per_sample = job.workload.data.tokens_per_sample
        interval_loss, interval_time, interval_steps = 0.0, 0.0, 0
        measured: dict[str, int] = {}
        on_cuda = getattr(self.engine.device, "type", "cpu") == "cuda"
        if self.start_step >= spec.steps:
            # Resumed from the last step's checkpoint (a rank died after writing it): no step is
            # left, but the run ends as every run does, with its final report and evaluation.
            # The loss is the one checkpointed with that step; nothing was timed.
            global_loss, = self._mean_over_ranks([self.resumed_loss])
            yield StepReport(rank=self.rank, step=spec.steps, loss=global_loss, local_loss=self.resumed_loss,
                             lr=self.engine.lr(), step_time_s=float("nan"), samples_per_s=float("nan"),
                             tokens_per_s=None, epoch=self.batches.state_dict()["epoch"],
                             first_batch_digest=self.first_batch_digest, evaluation=self.evaluate())
            return
        for step in range(self.start_step + 1, spec.steps + 1):
            started = time.perf_counter()
            probing = step == spec.memory_probe_step
            # On GPUs CUDA's allocator keeps the statistics; on CPU the tracker counts tensors.
            probe = PeakMemoryTracker() if probing and not on_cuda else contextlib.nullcontext()
            if probing and on_cuda:
                reset_cuda_peak(self.engine.device)
            with probe:
                step_loss = self.engine.train_step(self.train_batches, self._milestone)
            interval_time += time.perf_counter() - started
            if probing:
                measured = (cuda_memory_facts(self.engine.device) if on_cuda else
                            {"measured_peak_bytes": probe.peak, "measured_state_bytes": live_tensor_bytes()})
            interval_loss += step_loss
            interval_steps += 1
            last = step == spec.steps
            self.progress_step = step
            self._progress_at = time.monotonic()
            if step == self.start_step + 1 and getattr(self, "_sampler", None) is not None:
                # Sampling begins once training has: the MLflow import it needs would otherwise
                # hold up the first step, competing for this rank's CPU and interpreter lock.
                self._sampler.start()
            if spec.checkpoint_every and (step % spec.checkpoint_every == 0 or last):
                self._save(step, interval_loss / interval_steps)
            if step % spec.log_every and not last:
                continue
            local_loss = interval_loss / interval_steps
            global_loss, = self._mean_over_ranks([local_loss])
            evaluating = (spec.eval_every and step % spec.eval_every == 0) or last
            yield StepReport(
                rank=self.rank, step=step, loss=global_loss, local_loss=local_loss, lr=self.engine.lr(),
                step_time_s=interval_time / interval_steps,
                samples_per_s=samples_per_step * interval_steps / interval_time,
                tokens_per_s=(samples_per_step * tokens_per_sample * interval_steps / interval_time
                              if tokens_per_sample else None),
                epoch=self.batches.state_dict()["epoch"], first_batch_digest=self.first_batch_digest,
                evaluation=self.evaluate() if evaluating else {}, **measured)
            interval_loss, interval_time, interval_steps = 0.0, 0.0, 0

    def start(self) -> None:
        """Run :meth:`train` on a thread of its own and return at once.

        The driver then calls :meth:`poll`, which the actor keeps answering while the step
        runs. Polling works through every way of reaching Ray, Ray Client (``ray://``) included,
        which streaming generators do not, and a poll that stops being answered tells the
        driver the process is gone.
        """
        self._reports: list[StepReport] = []
        self._progress_at = time.monotonic()
        self._done = False
        self._error: str | None = None
        self._sampler = None
        if self._samples_node:
            from launchers.system_metrics import SystemSampler

            self._sampler = SystemSampler(self.job.system_metrics_interval_s)
        device = self.engine.device

        def run() -> None:
            try:
                if device is not None and getattr(device, "type", "cpu") == "cuda":
                    import torch

                    torch.cuda.set_device(device)  # the current device is per thread
                for report in self.train():
                    self._reports.append(report)  # list.append is atomic under the GIL
                if self._sampler is not None:
                    # Before _done: the poll that tells the driver this rank is done carries it.
                    self._sampler.finish()
            except BaseException:  # reported to the driver through poll(), never swallowed
                self._error = traceback.format_exc()
            finally:
                self._done = True

        self._thread = threading.Thread(target=run, name=f"train-rank{self.rank}", daemon=True)
        self._thread.start()

    def poll(self, seen: int) -> PollStatus:
        """This rank's reports after the first ``seen`` and the state of its training."""
        # Done first: a report the training thread appends after this read comes with the next
        # poll, where reading the reports first could miss the last one of a rank that is done.
        done, error = self._done, self._error
        return PollStatus(reports=self._reports[seen:], done=done, error=error, step=self.progress_step,
                          milestones=self.milestones, since_progress_s=time.monotonic() - self._progress_at,
                          system=self._sampler.take() if self._sampler is not None else [])

    def stacks(self) -> str:
        """Every thread's Python stack, answered even while the training thread is stuck."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in sys._current_frames().items():
            parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(parts)

    def consolidated_state(self) -> dict | None:
        """The whole model's weights on rank 0 (on CPU), None elsewhere; every rank calls it.

        With them, the engine's output on one held-out batch, to check the exported model
        against. Pipeline-parallel plans are not consolidated: each stage holds other layers.
        """
        import torch

        from plans.workload import move_batch, output_tensor

        if self.job.plan.pp > 1:
            return None
        # The inputs as the engine saw them (cast to the training precision), for the export's check.
        batch = move_batch(self.val_batches.sample_batch(), "cpu", self.engine.dtype)
        output = output_tensor(self.engine.outputs(batch))
        state = self.engine.consolidated_state()
        if self.rank != 0:
            return None
        return {"state": state, "batch": move_batch(batch, "cpu", torch.float32),
                "output": output.detach().float().cpu()}

    def shutdown(self) -> None:
        if getattr(self, "_sampler", None) is not None:
            self._sampler.stop()
        if self.engine is not None:
            self.engine.shutdown()
        else:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
