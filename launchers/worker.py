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
import shutil
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from launchers.devices import DeviceMapping
from launchers.ds_config import describe_optimizer, without_fused_adam
from launchers.gpu_worker import (
    accelerator_ids,
    cuda_memory_facts,
    fused_adam_problem,
    reset_cuda_peak,
    use_device,
)
from launchers.job import PollStatus, StepReport, TrainJob, WorkerFacts
from launchers.lean_startup import collector_paused, import_deepspeed
from launchers.placement import GRID_AXES, ParallelCoords, RankSlot, parallel_coords
from launchers.rendezvous import AGENT_STORE_ENV, RendezvousHost
from launchers.storage import RemoteDir, staging_dir
from plans.locations import is_remote, local_path
from plans.spec import Precision


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


def _digest(batch) -> str:
    """A fingerprint of a batch of any structure (tests compare the batches ranks read)."""
    import torch
    from torch.utils._pytree import tree_flatten

    digest = hashlib.sha1()
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            digest.update(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def _import_module_of(dotted: str) -> None:
    """Import the longest importable module prefix of a dotted ``_target_`` path."""
    import importlib

    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
            return
        except ImportError:
            continue


def _build_model(job: TrainJob):
    """The model, and how it was built.

    Under ZeRO-3 it is built inside ``deepspeed.zero.Init``: each rank allocates only its
    partition of every parameter as it is created, so no rank ever holds the whole model. That
    needs a model that initializes each parameter inside the module that owns it (Hugging Face
    models and the built-in GPT do); one that initializes a submodule's weights from its parent
    after the submodule is built (torchvision's ViT does) fails there, and is built whole instead.
    """
    if job.plan.zero_stage == 3 and job.plan.pp == 1 and job.plan.tp == 1:
        from launchers.zero_init import zero3_build
        from plans.meta import meta_device

        # zero.Init patches tensor construction; a library imported for the first time inside it
        # fails (torchvision registers tensor subclasses at import; transformers imports a model's
        # module, and through it torch._dynamo, at the model's first construction). So the model's
        # module comes first, then one build on meta, which imports whatever building it imports.
        _import_module_of(job.workload.model_config.get("_target_", ""))
        with meta_device():
            job.workload.model_factory()
        try:
            with zero3_build(job.ds_config):
                return job.workload.model_factory(), "zero.Init"
        except Exception as error:  # noqa: BLE001 - the model's own code, run under zero.Init
            reason = f"zero.Init failed: {type(error).__name__}: {error}"
            _refuse_whole_build_beyond_memory(job, reason)
            return job.workload.model_factory(), f"whole ({reason})"
    return job.workload.model_factory(), "whole"


def _refuse_whole_build_beyond_memory(job: TrainJob, reason: str) -> None:
    """Stop, with the reason, before building whole a model that the node's free memory cannot hold.

    The planner counted this rank's zero.Init share; a model whose code cannot run under
    zero.Init is built whole instead, by every local worker at once. Its size comes from a build
    on ``meta`` (no memory); the free memory is divided among the node's workers.
    """
    import psutil

    from plans.memory import model_stats
    from plans.meta import meta_device

    with meta_device():
        whole = model_stats(job.workload.model_factory()).built_bytes
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    share = psutil.virtual_memory().available // local
    if whole > share:
        raise RuntimeError(
            f"{job.workload.model_config.get('_target_', 'the model')} cannot be built under deepspeed.zero.Init "
            f"({reason}), and building it whole takes {whole / 2**30:.2f} GiB, more than this worker's "
            f"{share / 2**30:.2f} GiB share of the node's free memory. Initialize each parameter in the module "
            "that owns it (what zero.Init needs), or use fewer workers per node.")


def _matmul_tflops(precision: str, device, seconds: float = 0.1) -> float:
    """This worker's sustained dense matmul throughput in the training precision, measured.

    MFU is reported against it: on CPU workers there is no datasheet peak to quote, and on
    GPUs a measured figure also reflects clocks and power limits. It runs before the first step,
    so it is kept short: a tenth of a second of 1024-wide matmuls gives the same figure as three
    tenths within a few percent on a CPU core. A GPU does a 1024-wide matmul in microseconds,
    less than it takes to launch one, so there the matmuls are 8192 wide (a first run on an H100
    measured 160 TFLOP/s at 1024, against the 680 its calibration measured at 8192: MFU over 200%).
    """
    import torch

    on_cuda = getattr(device, "type", "cpu") == "cuda"
    size = 8192 if on_cuda else 1024
    dtype = Precision(precision).dtype
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    if on_cuda:
        torch.cuda.synchronize(device)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        if on_cuda:  # one at a time: the host would otherwise queue a second's worth before it waits
            torch.cuda.synchronize(device)
        runs += 1
    tflops = 2 * size**3 * runs / (time.perf_counter() - started) / 1e12
    del a, b
    if on_cuda:
        torch.cuda.empty_cache()  # the probe's 400 MB would otherwise stay reserved by the allocator
    return tflops


def unlink_shared_memory_buffers(master_addr: str, master_port: int) -> None:
    """Remove this run's names of DeepSpeed's CPU all-reduce buffers from /dev/shm.

    DeepSpeed's CPU backend creates a 67 MB shared-memory file per local rank at
    ``init_distributed`` and never deletes it; runs would pile them up until memory runs out.
    Every local rank has mapped every peer's buffer once ``init_distributed`` returned, so after
    a barrier the names can go: the memory stays mapped for this run and is freed by the kernel
    when the last worker exits, even one killed with SIGKILL.
    """
    import glob

    import deepspeed.comm as dist

    dist.barrier()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{master_addr}_{master_port}_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:  # a peer on this node removed it first
            pass


class _PipelineTensorGrid:
    """DeepSpeed's pipeline grid, answering the tensor-parallel questions AutoTP's engine asks too
    (its check that a tensor-parallel group reads one batch calls them on the engine's mpu)."""

    def __init__(self, grid):
        self._grid = grid

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def get_tensor_model_parallel_group(self):
        return self._grid.get_slice_parallel_group()

    def get_tensor_model_parallel_src_rank(self):
        """The global rank of tensor-parallel rank 0 in this rank's group."""
        return self._grid.slice_group[0]


class TrainWorker:
    """A DeepSpeed worker: one rank of the run."""

    def __init__(self):
        with collector_paused():  # torch's import, which this module leaves to here: start-up
            import torch  # noqa: F401

            match_torch_threads()
        self.engine = None
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
        """Join the process group and build the DeepSpeed engine; returns facts for the driver.

        ``streams`` is this rank's ``(training, evaluation)`` pair of a streamed data source
        (:class:`plans.workload.StreamingSource`): given to the first rank of each data-parallel
        replica, which reads it for the replica's other ranks.
        """
        with collector_paused():  # imports and the engine: start-up (launchers.lean_startup)
            return self._setup(job, slot, world_size, master_addr, master_port, streams)

    def _setup(self, job: TrainJob, slot: RankSlot, world_size: int, master_addr: str,
               master_port: int, streams: tuple[Any, Any] | None) -> WorkerFacts:
        self.rank, self.world_size = slot.rank, world_size
        self.local_rank = slot.local_rank
        self._samples_node = slot.local_rank == 0 and job.system_metrics_interval_s > 0
        os.environ.update(job.env)
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(slot.rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_SIZE": str(slot.local_world_size), "LOCAL_WORLD_SIZE": str(slot.local_world_size),
            **AGENT_STORE_ENV,
        })
        import torch

        deepspeed = import_deepspeed()
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)  # progress is reported by the driver, not by every rank
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        # DeepSpeed's pipeline sends activations with in-place collectives on tensors autograd
        # tracks; its engine routes their gradients explicitly (and the loss curves match data
        # parallelism exactly), so torch's per-step warning about them says nothing to the user.
        warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")

        from launchers.batches import ShardedBatches
        from plans.workload import StreamingSource

        self.job = job
        plan = job.plan
        backend = "gloo" if plan.accelerator.value == "cpu" else "nccl"
        if self.device_mapping is not None:
            use_device(self.device_mapping)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        unlink_shared_memory_buffers(master_addr, master_port)
        torch.manual_seed(job.train.seed)

        coords = parallel_coords(self.rank, world_size, plan.tp, plan.pp)
        built = "stages"
        if plan.pp > 1:
            module = self._pipeline_module(job)
            mpu = None  # the PipelineModule's own grid is the engine's mpu
            if plan.tp > 1:
                self._share_pipeline_groups_with_autotp(module)
        else:
            module, built = _build_model(job)
            if plan.activation_checkpointing:
                from plans.workload import enable_activation_checkpointing

                enable_activation_checkpointing(module)
            mpu = self._tensor_parallel_groups(coords)
        full_numel = sum(p.numel() for p in module.parameters())
        # What this rank holds right after construction (ZeRO-3 partitions: only its share).
        held_at_build = full_numel if plan.zero_stage != 3 else sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
        # With plan.tp > 1 the config's tensor_parallel section makes initialize() shard the model
        # (AutoTP) before ZeRO wraps it; the parameter generator is read after that, so the
        # optimizer gets the shards.
        ds_config, optimizer_note = job.ds_config, None
        fallback = without_fused_adam(job.ds_config) if plan.accelerator.value == "gpu" else job.ds_config
        if fallback is not job.ds_config and (problem := fused_adam_problem()):
            ds_config = fallback
            optimizer_note = f"torch's fused AdamW (DeepSpeed's FusedAdam: {problem})"
        self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                    config=ds_config, mpu=mpu)
        self._dtype = None if plan.precision == Precision.fp32 else plan.precision.dtype
        if self._dtype is not None:
            # DeepSpeed casts the parameters to the training precision but leaves floating-point
            # buffers (BatchNorm's running statistics) in fp32, which the layers then refuse.
            for buffer in module.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(self._dtype)
        if plan.pp > 1:
            self._mark_stage_parameters(module, coords)
        if plan.pp > 1 and plan.tp > 1:
            # AutoTP set the engine's mpu to deepspeed.utils.groups, which knows no pipeline;
            # the pipeline engine asks its mpu for the pipe group every step.
            self.engine.mpu = _PipelineTensorGrid(self.engine.grid)
            # The checkpoint's model-parallel rank and size were fixed during initialize() from
            # the tensor-parallel group alone: the stages' tp rank 0 would all write one and the
            # same ZeRO file. The pipe x tensor group tells them apart, as without AutoTP.
            self.engine.checkpoint_mp_rank = self.engine.grid.get_model_parallel_rank()
            self.engine.mp_world_size = self.engine.grid.get_model_parallel_world_size()
        if plan.tp > 1 and sum(p.numel() for p in module.parameters()) == full_numel:
            raise RuntimeError(f"plan.tp={plan.tp}, but no layer of {type(module).__name__} matched the "
                               "tensor-parallel layer specs: every rank would hold and compute the whole model")
        from launchers.memory_probe import TensorsMade

        # The data's own tensors (an in-memory corpus, decoded images) are not the model's: the
        # measured memory is compared with the planner's prediction without them.
        data_tensors = TensorsMade() if job.train.memory_probe_step else contextlib.nullcontext()
        data = job.workload.data
        # The ranks of one tensor-parallel group hold shards of one replica: they read the same batch.
        dp_rank = coords.dp_rank
        with data_tensors:
            if isinstance(data, StreamingSource):
                self.batches, self.val_batches = self._streamed_batches(data, streams, coords)
            else:
                data.prepare()
                train_set, val_set = data.datasets()
                collate = data.collate()
                self.batches = ShardedBatches(train_set, batch_size=plan.micro_batch_size, dp_rank=dp_rank,
                                              dp_size=plan.dp, seed=job.train.seed, collate=collate)
                self.val_batches = ShardedBatches(val_set, batch_size=plan.micro_batch_size, dp_rank=dp_rank,
                                                  dp_size=plan.dp, seed=job.train.seed, shuffle=False,
                                                  collate=collate)
        data_tensor_bytes = data_tensors.bytes if job.train.memory_probe_step else 0
        self.start_step = self._resume(job) if job.resume_tag else 0
        self.first_batch_digest: str | None = None
        self.train_batches = self._recorded(self.batches)
        return WorkerFacts(rank=self.rank, pid=os.getpid(), hostname=socket.gethostname(), dp_rank=dp_rank,
                           tp_rank=coords.tp_rank, pp_rank=coords.pp_rank, start_step=self.start_step,
                           params_on_rank=sum(p.numel() for p in module.parameters()),
                           params_at_build=held_at_build, built=built, data_tensor_bytes=data_tensor_bytes,
                           optimizer_note=optimizer_note, optimizer=describe_optimizer(self.engine.basic_optimizer),
                           peak_tflops=_matmul_tflops(plan.precision.value, self.engine.device),
                           torch_threads=torch.get_num_threads())

    def _pipeline_module(self, job: TrainJob):
        """The model as DeepSpeed pipeline stages; this rank builds only its own stage's layers.

        The grid is ours (:func:`parallel_coords`, axes :data:`GRID_AXES`), handed to DeepSpeed as
        a ``ProcessTopology``, so the stage, replica and data shard of every rank are what
        ``orch check`` showed. With activation checkpointing each layer with parameters is
        recomputed in backward (``activation_checkpoint_interval=1``), with torch's
        non-reentrant checkpoint as the model's own switch uses.
        """
        import functools

        import torch.utils.checkpoint
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        plan = job.plan
        if job.workload.pipeline_layers is None:
            raise RuntimeError(f"plan.pp={plan.pp} but the job carries no pipeline layers for the model")
        recompute = {}
        if plan.activation_checkpointing:
            recompute = {"activation_checkpoint_interval": 1,
                         "activation_checkpoint_func": functools.partial(torch.utils.checkpoint.checkpoint,
                                                                         use_reentrant=False)}
        topology = ProcessTopology(axes=list(GRID_AXES), dims=[plan.dp, plan.pp, plan.tp])
        objective = job.workload.objective

        def loss_fn(outputs, targets):
            # DeepSpeed's pipeline hands the last stage the batch's targets alone.
            return objective(outputs, (None, targets))

        module = PipelineModule(layers=job.workload.pipeline_layers(), topology=topology, loss_fn=loss_fn,
                                partition_method=plan.pp_partition, **recompute)
        return module

    @staticmethod
    def _mark_stage_parameters(module, coords: ParallelCoords) -> None:
        """Make DeepSpeed's gradient norm count every parameter of the model exactly once.

        DeepSpeed 0.19's clipping without ZeRO (runtime/utils.py ``clip_grad_norm_``) sums, over
        the model-parallel group (pipe x tensor), the parameters of model-parallel rank 0 and
        those marked model-parallel elsewhere. In a pipeline every stage but the first is a rank
        > 0, so its layers would be left out and the run would clip too little. Marked here: each
        stage's parameters on tensor-parallel rank 0, except the copies of tied weights a later
        stage holds (DeepSpeed marks them ``ds_pipe_replicated``); AutoTP already marks the
        shards every tensor-parallel rank holds (``tensor_model_parallel``). ZeRO-1 and bf16
        compute their norms elsewhere and read the same marks.
        """
        if coords.tp_rank != 0:
            return
        for param in module.parameters():
            if not getattr(param, "ds_pipe_replicated", False):
                param.model_parallel = True

    @staticmethod
    def _share_pipeline_groups_with_autotp(module) -> None:
        """Make AutoTP shard each stage over the pipeline grid's tensor-parallel group.

        DeepSpeed's AutoTP training builds its groups as a 2D (data, tensor) mesh over the whole
        world (``groups._init_tp_mesh_device``), which would put different pipeline stages in one
        data-parallel group. It keeps groups that already exist, so the grid's are set first:
        tensor-parallel = the grid's "model" axis, data-parallel = its "data" axis, and
        model-parallel = pipe x model (what gradient clipping sums the norm over).
        """
        from deepspeed.utils import groups

        grid = module._grid
        groups._TENSOR_MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
        groups._DATA_PARALLEL_GROUP = grid.get_data_parallel_group()
        groups._MODEL_PARALLEL_GROUP = grid.get_model_parallel_group()

    def _recorded(self, batches):
        """The training batches, fingerprinting the first this rank reads (tests compare them)."""
        for batch in batches:
            if self.first_batch_digest is None:
                self.first_batch_digest = _digest(batch)
            yield batch

    def _resume(self, job: TrainJob) -> int:
        """Load model, optimizer and scheduler (DeepSpeed), then data position and RNG; return the step."""
        import torch

        from launchers.safe_load import verified_loading, weights_only_loading

        # A checkpoint file must not be able to run code, and must be the one its manifest lists.
        root = self._checkpoint_root()
        if is_remote(job.train.checkpoint_dir):
            self._download(job.resume_tag)
        folder = os.path.join(root, job.resume_tag)
        if self.engine.load_universal_checkpoint():
            # DeepSpeed reads universal checkpoints past the checkpoint engine, with torch.load itself.
            with verified_loading(folder):
                _, client_state = self.engine.load_checkpoint(root, tag=job.resume_tag)
        else:
            with weights_only_loading(self.engine, folder):
                _, client_state = self.engine.load_checkpoint(root, tag=job.resume_tag)
        if is_remote(job.train.checkpoint_dir):
            torch.distributed.barrier()  # every rank of the node has read its files
            if self.local_rank == 0:
                shutil.rmtree(root, ignore_errors=True)
        if client_state is None:
            raise RuntimeError(f"checkpoint {job.resume_tag} in {job.train.checkpoint_dir} could not be loaded")
        data, val_data = client_state["data"], client_state["val_data"]
        saved = client_state.get("layout")
        plan = job.plan
        if saved and (saved["dp"], saved["micro_batch_size"]) != (plan.dp, plan.micro_batch_size):
            from launchers.universal import resumed_position

            data = {**data, "position": resumed_position(data["position"], saved, plan.micro_batch_size, plan.dp)}
            val_data = {**val_data, "position": resumed_position(val_data["position"], saved,
                                                                 plan.micro_batch_size, plan.dp)}
        self.batches.load_state_dict(data)
        self.val_batches.load_state_dict(val_data)
        torch.set_rng_state(client_state["rng"])
        self.resumed_loss = float(client_state.get("loss", float("nan")))
        return int(client_state["step"])

    def _save(self, step: int, loss: float) -> None:
        """Write this rank's part of the checkpoint; rank 0 publishes it once every rank is done.
        ``loss`` is this rank's mean training loss over the steps since its last report: an
        attempt resumed from the last step's checkpoint has no step left to train, and reports it."""
        import deepspeed.comm as dist
        import torch

        from launchers.checkpoint import publish, publish_remote, tag_for
        from launchers.manifest import file_digests
        from launchers.universal import layout_of

        spec = self.job.train
        layout = layout_of(self.job.plan)
        client_state = {"step": step, "data": self.batches.state_dict(), "val_data": self.val_batches.state_dict(),
                        "rng": torch.get_rng_state(), "layout": layout, "loss": loss}
        root, tag = self._checkpoint_root(), tag_for(step)
        remote = is_remote(spec.checkpoint_dir)
        # What an earlier attempt left under this tag (a run resumed from an older checkpoint
        # writes the same steps again) must not end up in this checkpoint's manifest.
        if self.rank == 0:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
            if remote:
                RemoteDir(spec.checkpoint_dir).delete(tag)
        if remote and self.local_rank == 0:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
        dist.barrier()
        self.engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
        dist.barrier()
        if not remote:
            if self.rank == 0:
                publish(root, step, self.job.run_id, spec.keep_checkpoints, layout=layout,
                        model=self.job.model_signature)
            dist.barrier()
            return
        # Each node's first worker digests and uploads what the node wrote; once every node has
        # (the gather waits for them), rank 0 publishes.
        written, folder = ({}, {}), os.path.join(root, tag)
        # (A node whose ranks write nothing, as at ZeRO stage 0 beyond rank 0, may have no folder.)
        if self.local_rank == 0 and os.path.isdir(folder):
            written = file_digests(folder)
            RemoteDir(spec.checkpoint_dir).upload(folder, tag)
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, written)
        if self.rank == 0:
            files = {name: digest for digests, _ in gathered for name, digest in digests.items()}
            sizes = {name: size for _, node_sizes in gathered for name, size in node_sizes.items()}
            publish_remote(spec.checkpoint_dir, step, self.job.run_id, spec.keep_checkpoints, files, sizes,
                           layout=layout, model=self.job.model_signature)
        dist.barrier()
        if self.local_rank == 0:  # the staging copy, and the scripts DeepSpeed copies beside its tags
            shutil.rmtree(root, ignore_errors=True)

    def _checkpoint_root(self) -> str:
        """Where DeepSpeed writes and reads checkpoints: ``train.checkpoint_dir``, or for a URI this
        node's staging directory (:mod:`launchers.storage`)."""
        location = self.job.train.checkpoint_dir
        if not is_remote(location):
            return local_path(location)
        import ray

        return str(staging_dir(location, ray.get_runtime_context().get_node_id()))

    def _download(self, tag: str) -> None:
        """Bring a remote tag into this node's staging directory (its first worker downloads it,
        and checks every file against the manifest before any rank loads it)."""
        import torch

        from launchers.checkpoint import download_verified

        folder = os.path.join(self._checkpoint_root(), tag)
        if self.local_rank == 0:
            download_verified(self.job.train.checkpoint_dir, tag, folder)
        torch.distributed.barrier()

    def _streamed_batches(self, data, streams: tuple[Any, Any] | None, coords: ParallelCoords):
        """Training and evaluation batches of a streamed source, shared within each replica.

        A replica's readers are its ranks that take batches: every tensor-parallel rank, of the
        first and the last pipeline stage only (the stages between receive activations). Every
        rank creates every replica's group, as ``new_group`` requires, in the same order.
        """
        import torch.distributed as dist

        from launchers.batches import ReplicaBatches, StreamedBatches

        plan = self.job.plan
        readers_of = []
        for dp_rank in range(plan.dp):
            stages = sorted({0, plan.pp - 1})
            readers_of.append([(dp_rank * plan.pp + stage) * plan.tp + tp_rank
                               for stage in stages for tp_rank in range(plan.tp)])
        groups = [dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None for ranks in readers_of]
        readers = readers_of[coords.dp_rank]
        group = groups[coords.dp_rank]
        if self.rank == readers[0] and streams is None:
            raise RuntimeError(f"rank {self.rank} leads data-parallel replica {coords.dp_rank} but got no data stream")
        pair = []
        for index, shuffle in ((0, data.shuffle_buffer), (1, 0)):
            source = None
            if self.rank == readers[0]:
                source = StreamedBatches(streams[index], batch_size=plan.micro_batch_size, seed=self.job.train.seed,
                                         to_batch=data.to_batch(), shuffle_buffer=shuffle)
            pair.append(ReplicaBatches(source, group=group, src=readers[0], peers=readers[1:], tag=index))
        return pair[0], pair[1]

    def _tensor_parallel_groups(self, coords: ParallelCoords):
        """DeepSpeed's tensor- and data-parallel groups, built before ``deepspeed.initialize`` (None at tp=1).

        initialize() would build the same groups itself, but only after it has checked the batch
        sizes against the world size, counting every rank as a data-parallel replica: with the
        groups passed as ``mpu`` it counts dp ranks only, so ``train_batch_size`` stays
        micro × accumulation × dp. The layout is ours (:func:`parallel_coords`); a DeepSpeed
        that grouped ranks differently would feed one tensor-parallel group different data.
        """
        if self.job.plan.tp == 1:
            return None
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.job.plan.tp)
        theirs = (groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank())
        if theirs != (coords.dp_rank, coords.tp_rank):
            raise RuntimeError(f"rank {self.rank}: DeepSpeed placed it at (dp_rank, tp_rank) = {theirs}, "
                               f"the orchestrator at {(coords.dp_rank, coords.tp_rank)}")
        return groups

    def _batch(self, batch):
        from plans.workload import move_batch

        return move_batch(batch, self.engine.device, self._dtype)

    def _loss(self, batch):
        return self.job.workload.loss(self.engine, self._batch(batch))

    def _mean_over_ranks(self, values: list[float]) -> list[float]:
        import deepspeed.comm as dist
        import torch

        # On the engine's device: NCCL reduces device tensors only.
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def evaluate(self) -> dict[str, float]:
        """The held-out loss, and the objective's own metrics (``eval_<name>``), averaged over
        ``train.eval_batches`` batches and the ranks."""
        import torch

        from plans.workload import call_model

        batches = self.job.train.eval_batches
        if self.job.plan.pp > 1:
            # The last stage computes the loss; DeepSpeed averages it over the micro-batches and
            # the data-parallel replicas and broadcasts it to every stage.
            loss = self.engine.eval_batch(self.val_batches, num_micro_batches=batches)
            self.engine.train()
            return {"eval_loss": self._mean_over_ranks([loss.item()])[0]}
        objective = self.job.workload.objective
        metrics = getattr(objective, "metrics", None)
        self.engine.eval()
        totals: dict[str, float] = {}
        with torch.no_grad():
            for _ in range(batches):
                batch = self._batch(next(self.val_batches))
                outputs = call_model(self.engine, batch)
                found = {"loss": objective(outputs, batch), **(metrics(outputs, batch) if metrics else {})}
                for name, value in found.items():
                    totals[name] = totals.get(name, 0.0) + float(value)
        self.engine.train()
        names = sorted(totals)
        means = self._mean_over_ranks([totals[name] / batches for name in names])
        return {f"eval_{name}": mean for name, mean in zip(names, means, strict=True)}

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
                             lr=self.engine.get_lr()[0], step_time_s=float("nan"), samples_per_s=float("nan"),
                             tokens_per_s=None, epoch=self.batches.state_dict()["epoch"],
                             first_batch_digest=self.first_batch_digest, evaluation=self.evaluate())
            return
        self.engine.train()
        for step in range(self.start_step + 1, spec.steps + 1):
            started = time.perf_counter()
            step_loss = 0.0
            probing = step == spec.memory_probe_step
            # On GPUs CUDA's allocator keeps the statistics; on CPU the tracker counts tensors.
            probe = PeakMemoryTracker() if probing and not on_cuda else contextlib.nullcontext()
            if probing and on_cuda:
                reset_cuda_peak(self.engine.device)
            with probe:
                if plan.pp > 1:
                    # One call runs every micro-batch through the stages (DeepSpeed's 1F1B schedule)
                    # and steps the optimizer; the loss comes back to every stage, averaged.
                    step_loss = self.engine.train_batch(data_iter=self.train_batches).item() * plan.grad_accum_steps
                    self.milestones += 3
                else:
                    for _ in range(plan.grad_accum_steps):
                        loss = self._loss(next(self.train_batches))
                        self.milestones += 1
                        self.engine.backward(loss)
                        self.milestones += 1
                        self.engine.step()
                        self.milestones += 1
                        step_loss += loss.item()
            interval_time += time.perf_counter() - started
            if probing:
                measured = (cuda_memory_facts(self.engine.device) if on_cuda else
                            {"measured_peak_bytes": probe.peak, "measured_state_bytes": live_tensor_bytes()})
            interval_loss += step_loss / plan.grad_accum_steps
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
                rank=self.rank, step=step, loss=global_loss, local_loss=local_loss, lr=self.engine.get_lr()[0],
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
        device = getattr(self.engine, "device", None)

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
        """The whole model's weights on rank 0 (on CPU), None elsewhere.

        ZeRO-3 gathers every partition and tensor parallelism every AutoTP shard (all ranks call
        this, through DeepSpeed's consolidation for either); the other plans hold the whole model
        on every rank already. Pipeline-parallel plans are not consolidated here: each stage holds
        different layers under the pipeline's own names.
        """
        import torch

        from plans.workload import call_model, move_batch, output_tensor

        plan = self.job.plan
        if plan.pp > 1:
            return None
        # The engine's output on one held-out batch, for checking the exported model against it.
        batch = self._batch(self.val_batches.sample_batch())
        self.engine.eval()
        with torch.no_grad():
            output = output_tensor(call_model(self.engine, batch))
        self.engine.train()
        if plan.zero_stage == 3 or plan.tp > 1:
            state = self.engine._consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict()
        if self.rank != 0:
            return None
        return {"state": {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()},
                "batch": move_batch(batch, "cpu", torch.float32), "output": output.detach().float().cpu()}

    def shutdown(self) -> None:
        import deepspeed.comm as dist

        if getattr(self, "_sampler", None) is not None:
            self._sampler.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
