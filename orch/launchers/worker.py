"""One training process, run inside a Ray actor: the loop.

The actor is created by :mod:`orch.launchers.worker_group`. The engine (:mod:`orch.launchers.engines`,
chosen by ``plan.engine``) owns the model, the optimizer and their checkpoint files; the worker
reads as the algorithm: set up, then for each step a batch, a step, a report and a checkpoint,
then finish. The driver calls :meth:`TrainWorker.start` and then polls
(:mod:`orch.launchers.driver_link`): reports come back per logged step, and a poll that stops being
answered tells it the process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from orch.launchers.checkpoint_io import CheckpointIO
from orch.launchers.devices import DeviceMapping
from orch.launchers.driver_link import DriverLink, thread_stacks
from orch.launchers.engines import Engine, engine_for
from orch.launchers.export_state import consolidated_state
from orch.launchers.gpu_worker import (
    accelerator_ids,
    cuda_memory_facts,
    leftover_tensor_bytes,
    release_cached_device_memory,
    reset_cuda_peak,
    use_device,
)
from orch.launchers.job import PollStatus, StepReport, TrainJob, WorkerFacts
from orch.launchers.lean_startup import collector_paused
from orch.launchers.placement import RankSlot
from orch.launchers.process_baseline import ProcessBaseline
from orch.launchers.rank_state import restore_rank_state, save_rank_state
from orch.launchers.rendezvous import AGENT_STORE_ENV, RendezvousHost
from orch.launchers.step_interval import Interval
from orch.launchers.torch_threads import match_torch_threads
from orch.launchers.worker_data import digest, rank_batches
from orch.plans.parallel.rank_layout import parallel_coords

REUSABLE_LEFTOVER_BYTES = 1 << 20
"""The most tensor bytes a reset worker may still hold and be reused. DeepSpeed's ZeRO-3 leaves
its partitions held from outside Python after ``destroy``, out of the collector's reach; kept,
they would be counted in the next run's measured memory and, on a GPU, take from its device."""


class TrainWorker:
    """One rank of the run."""

    def __init__(self):
        with collector_paused():  # torch's import, which this module leaves to here: start-up
            import torch  # noqa: F401

            match_torch_threads()
        self.baseline = ProcessBaseline.now()
        """This process before its first run: a reused worker goes back to it (:meth:`reset`)."""
        self.device_mapping: DeviceMapping | None = None
        self._fresh()

    def _fresh(self) -> None:
        """The state a run begins from."""
        self.engine: Engine | None = None
        self.link = DriverLink()
        self.start_step = 0
        self.stop_requested = False
        """The driver asked the group to stop at its next checkpoint (:meth:`stop_at_next_checkpoint`)."""
        self.clock = None
        """The phase clock of the steps being trained (:mod:`orch.launchers.step_phases`), once training began."""
        self.rendezvous: RendezvousHost | None = None
        """The process group's store, hosted here when this actor is rank 0 (:meth:`address`)."""

    def address(self) -> tuple[str, int]:
        """Where this actor, as rank 0, hosts the rendezvous: its node's IP and a port bound there."""
        import ray

        self.rendezvous = RendezvousHost(ray.util.get_node_ip_address())
        return self.rendezvous.address

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def accelerator_ids(self) -> tuple[str, list[str]]:
        """This actor's node and the GPU ids Ray gave it (:func:`orch.launchers.gpu_worker.accelerator_ids`)."""
        return accelerator_ids()

    def use_devices(self, mapping: DeviceMapping) -> None:
        """Remember this rank's GPU mapping; :meth:`setup` applies it before the process group starts."""
        self.device_mapping = mapping

    def setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str,
              master_port: int, streams: tuple[Any, Any] | None = None) -> WorkerFacts:
        """Join the process group, build the engine and this rank's batches; returns facts for the driver.

        ``streams`` is this rank's ``(training, evaluation)`` pair of a streamed data source
        (:class:`orch.plans.model.workload.StreamingSource`): given to the first rank of each data-parallel
        replica, which reads it for the replica's other ranks.
        """
        with collector_paused():  # imports and the engine: start-up (orch.launchers.lean_startup)
            return self._setup(job, slot, world_size, master_addr, master_port, streams)

    def _setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str,
               master_port: int, streams: tuple[Any, Any] | None) -> WorkerFacts:
        import torch

        self.job, self.rank, self.world_size, self.local_rank = job, slot.rank, world_size, slot.local_rank
        os.environ.update(job.env)
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(slot.rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_SIZE": str(slot.local_world_size), "LOCAL_WORLD_SIZE": str(slot.local_world_size),
            **AGENT_STORE_ENV,
        })
        if self.device_mapping is not None:
            use_device(self.device_mapping)
        self.engine = engine_for(job.plan.engine)
        self.engine.start(job, master_addr, master_port)
        torch.manual_seed(job.train.seed)
        coords = parallel_coords(self.rank, world_size, job.plan.tp, job.plan.pp, job.plan.cp)
        built = self.engine.build(job, coords)
        self.batches, self.val_batches, data_tensor_bytes = rank_batches(job, self.rank, coords, streams)
        self.checkpoints = CheckpointIO(job, self.rank, self.local_rank, world_size)
        if job.resume_tag:
            resumed = restore_rank_state(self.checkpoints, self.engine, job, job.resume_tag,
                                         self.batches, self.val_batches)
            self.start_step, self.resumed_loss = resumed.step, resumed.loss
        self.first_batch_digest: str | None = None
        self.train_batches = self._recorded(self.batches)
        if job.train.profile_steps:
            from orch.launchers.step_profile import prepare_profiler

            prepare_profiler()
        return WorkerFacts(rank=self.rank, pid=os.getpid(), hostname=socket.gethostname(), dp_rank=coords.dp_rank,
                           tp_rank=coords.tp_rank, pp_rank=coords.pp_rank, start_step=self.start_step,
                           model=built, data_tensor_bytes=data_tensor_bytes,
                           peak_tflops=self._peak_tflops(),
                           torch_threads=torch.get_num_threads())

    def _peak_tflops(self) -> float:
        """The matmul rate MFU is reported against: the cluster profile's, else measured here the way
        the steps compute."""
        from orch.launchers.matmul_probe import matmul_tflops

        if self.job.mfu_peak_tflops:
            return self.job.mfu_peak_tflops
        with self._kernels():
            return matmul_tflops(self.job.plan.precision.value, self.engine.device)

    def _recorded(self, batches):
        """The training batches, fingerprinting the first this rank reads (tests compare them), and
        the time each took to draw handed to the step's phase clock (``data_wait``)."""
        found = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(found)
            except StopIteration:
                return
            if self.clock is not None:
                self.clock.data_wait(time.perf_counter() - started)
            if self.first_batch_digest is None:
                self.first_batch_digest = digest(batch)
            yield batch

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
        with self._kernels():
            found = self.engine.evaluate(self.val_batches, self.job.train.eval_batches)
        names = sorted(found)
        means = self._mean_over_ranks([found[name] for name in names])
        return {f"eval_{name}": mean for name, mean in zip(names, means, strict=True)}

    def _kernels(self):
        """The kernels this rank computes with (:func:`orch.launchers.cpu_bf16.bf16_in_fp32`)."""
        from orch.launchers.cpu_bf16 import bf16_in_fp32

        return bf16_in_fp32(self.job.plan.precision.value, self.engine.device)

    def _timed_evaluation(self) -> tuple[dict[str, float], float]:
        """:meth:`evaluate`, and the seconds it took."""
        started = time.perf_counter()
        return self.evaluate(), time.perf_counter() - started

    def _report(self, step: int, local_loss: float, rates: dict, evaluating: bool,
                evaluated: tuple[dict[str, float], float] | None = None, **measured) -> StepReport:
        """The report of ``step``: the loss averaged over the ranks (a collective every rank joins),
        and the evaluation (``evaluated`` when it ran before the step's checkpoint)."""
        global_loss, = self._mean_over_ranks([local_loss])
        if evaluated is None:
            evaluated = self._timed_evaluation() if evaluating else ({}, 0.0)
        evaluation, eval_s = evaluated
        return StepReport(rank=self.rank, step=step, loss=global_loss, local_loss=local_loss, lr=self.engine.lr(),
                          epoch=self.batches.state_dict()["epoch"], first_batch_digest=self.first_batch_digest,
                          evaluation=evaluation, eval_s=eval_s, **rates, **measured)

    def train(self) -> Iterator[StepReport]:
        """Run ``train.steps`` optimizer steps; yield a report every ``train.log_every`` steps.

        Step ``train.memory_probe_step`` runs under a :class:`PeakMemoryTracker`; from then on
        every report carries this rank's measured peak and post-step tensor bytes, which the
        planner's prediction is checked against. The tracker slows that one step down, and its
        time is part of the interval's ``step_time_s``.
        """
        from orch.launchers.memory_probe import PeakMemoryTracker, live_tensor_bytes
        from orch.launchers.step_phases import phase_clock
        from orch.launchers.step_profile import StepProfile, profiled_step

        job, plan, spec = self.job, self.job.plan, self.job.train
        interval = Interval(samples_per_step=plan.micro_batch_size * plan.grad_accum_steps,
                            tokens_per_sample=job.workload.data.tokens_per_sample)
        measured: dict[str, int] = {}
        on_cuda = getattr(self.engine.device, "type", "cpu") == "cuda"
        clock = self.clock = phase_clock(spec.log_every, self.engine.device if on_cuda else None)

        def milestone(phase: str = "") -> None:
            self.link.milestone()
            clock.milestone(phase)
        if self.start_step >= spec.steps:
            # Resumed from the last step's checkpoint (a rank died after writing it): no step is
            # left, but the run ends as every run does, with its final report and evaluation.
            # The loss is the one checkpointed with that step; nothing was timed.
            nothing = {"step_time_s": float("nan"), "samples_per_s": float("nan"), "tokens_per_s": None}
            yield self._report(spec.steps, self.resumed_loss, nothing, evaluating=True)
            return
        saved_s = 0.0
        profiles: list[StepProfile] = []
        for step in range(self.start_step + 1, spec.steps + 1):
            started = time.perf_counter()
            probing = step == spec.memory_probe_step
            # On GPUs CUDA's allocator keeps the statistics; on CPU the tracker counts tensors.
            probe = (PeakMemoryTracker(detail=spec.memory_probe_detail) if probing and not on_cuda
                     else contextlib.nullcontext())
            if probing and on_cuda:
                reset_cuda_peak(self.engine.device)
            # A profiled step is slowed by its profiler: left out of the phase timing and the rates.
            profiling = step in spec.profile_steps
            clock.begin(step, skip=probing or profiling)
            profiler = profiled_step(step, self.engine.device, milestone) if profiling else contextlib.nullcontext()
            # The bf16 path outside the probe: the probe counts the bf16 tensors a step makes, not
            # the fp32 temporaries computing them.
            with self._kernels(), probe, profiler as profiled:
                step_loss = self.engine.train_step(self.train_batches,
                                                   profiled.milestone if profiled is not None else milestone)
            clock.end()
            interval.add(step_loss, time.perf_counter() - started, timed=not profiling)
            if profiled is not None:
                profiles += profiled.profiles
            if probing:
                measured = (cuda_memory_facts(self.engine.device) if on_cuda else
                            {"measured_peak_bytes": probe.peak, "measured_state_bytes": live_tensor_bytes()})
                if not on_cuda and probe.detail:
                    measured["memory_at_peak"] = [dataclasses.asdict(held) for held in probe.at_peak()]
            last = step == spec.steps
            self.link.stepped(step)
            evaluating = bool(spec.eval_every and step % spec.eval_every == 0) or last
            # A reported step evaluates before its checkpoint: the checkpoint then holds the held-out
            # data's position after the evaluation, and a resumed run evaluates the batches an
            # uninterrupted one would.
            evaluated = self._timed_evaluation() if evaluating and (last or not step % spec.log_every) else None
            stopping = False
            if spec.checkpoint_every and (step % spec.checkpoint_every == 0 or last):
                saving = time.perf_counter()
                # The last step's checkpoint is written at once: the run ends with it published.
                # So is one the group stops at.
                stopping = not last and self._stop_agreed()
                save_rank_state(self.checkpoints, self.engine, job, step, interval.mean_loss, self.batches,
                                self.val_batches, background=spec.async_checkpoint and not last and not stopping)
                saved_s += time.perf_counter() - saving
            if step % spec.log_every and not last and not stopping:
                continue
            yield self._report(step, interval.mean_loss, interval.rates(), evaluating, evaluated,
                               phase_time_s=clock.take(),
                               steps=interval.timed_steps, checkpoint_s=saved_s, profiles=profiles, **measured)
            measured.pop("memory_at_peak", None)  # reported once; the peak's bytes go with every report
            interval.reset()
            saved_s, profiles = 0.0, []
            if stopping:
                return  # the driver resumes this checkpoint with another plan

    def stop_at_next_checkpoint(self) -> None:
        """Stop training after the next checkpoint (with its report) instead of at the last step: an
        elastic run goes back to its declared plan there. Answered while the step runs."""
        self.stop_requested = True

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (:meth:`stop_at_next_checkpoint`): the ranks agree through
        one all-reduce at each checkpoint of an elastic run, so all stop at the same one, whichever
        of them the driver's request reached first."""
        if not self.job.train.elastic.enabled:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def start(self) -> None:
        """Run :meth:`train` on a thread of its own and return at once; the driver then calls
        :meth:`poll`, which the actor keeps answering while the step runs."""
        if self.local_rank == 0 and self.job.system_metrics_interval_s > 0:
            self.link.sample_system(self.job.system_metrics_interval_s)
        self.link.run(self.train, self.engine.device, name=f"train-rank{self.rank}")

    def poll(self, seen: int) -> PollStatus:
        """This rank's reports after the first ``seen`` and the state of its training."""
        return self.link.poll(seen)

    def stacks(self) -> str:
        """Every thread's Python stack, answered even while the training thread is stuck."""
        return thread_stacks()

    def consolidated_state(self) -> dict | None:
        """The whole model's weights on rank 0 (:func:`orch.launchers.export_state.consolidated_state`)."""
        return consolidated_state(self.engine, self.val_batches, self.rank, self.job.plan.pp)

    def reset(self) -> bool:
        """Leave the finished run behind so that this process can serve the driver's next run
        (:mod:`orch.launchers.worker_pool`): the process group and its store go, the engine and
        the run's data are dropped, and the environment, import path and user modules are put
        back as they were before the first run. ``False`` when the training thread is still
        running, or when more than :data:`REUSABLE_LEFTOVER_BYTES` of tensors outlive the run
        (something the collector cannot free still holds them): such a worker is not reused."""
        thread = getattr(self.link, "thread", None)
        if thread is not None:
            thread.join(timeout=10)
            if thread.is_alive():
                return False
        self.shutdown()
        if self.rendezvous is not None:
            self.rendezvous.close()
        mapping = self.device_mapping
        for name in [name for name in vars(self) if name not in ("baseline", "device_mapping")]:
            delattr(self, name)
        self._fresh()
        self.device_mapping = mapping
        self.baseline.restore()
        match_torch_threads()  # the thread pool as placed, whatever the user's code set it to
        release_cached_device_memory()
        return leftover_tensor_bytes() <= REUSABLE_LEFTOVER_BYTES

    def shutdown(self) -> None:
        self.link.stop()
        if self.engine is not None:
            self.engine.shutdown()
        else:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
