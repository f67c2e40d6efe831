"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the engine seam, ``plan.engine=fsdp2``.

The model is built whole on every rank from the same seed, activation checkpointing is switched
on (:func:`orch.plans.model.workload.enable_activation_checkpointing`, which keeps parameter names), tensor
parallelism applied through DTensor (:mod:`orch.launchers.engines.fsdp2.layout`) and then each
repeated block and the root are sharded over the data-parallel ranks. The optimizer and
schedule are torch's, built from the run's engine-neutral settings (``job.optim``) and equal to a
DeepSpeed run's (:mod:`orch.launchers.engines.fsdp2.torch_optim`);
checkpoints go through ``torch.distributed.checkpoint``, which reshards on load, so a run
resumes at another dp or tp. Nothing unverified is unpickled (:mod:`orch.launchers.engines.fsdp2.dcp_files`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from orch.launchers.engines.base import BuiltModel, Engine, cast_float_buffers, mean_objective, whole_tensor

if TYPE_CHECKING:
    import torch

    from orch.launchers.job import TrainJob
    from orch.plans.parallel.rank_layout import ParallelCoords


class FSDP2Engine(Engine):
    """One rank of an FSDP2 run (with DTensor tensor parallelism when ``plan.tp > 1``)."""

    name = "fsdp2"
    pipeline = None
    """This rank's pipeline stages and schedule, with pp > 1
    (:class:`orch.launchers.engines.fsdp2.pipeline.Pipeline`)."""
    _checkpoint_group = None
    """The gloo group background checkpoint writes coordinate on (:meth:`save_async`), made at the first."""
    context = None
    """This rank's part of each sequence, with ``plan.cp > 1``
    (:class:`orch.launchers.engines.fsdp2.context.ContextSplit`)."""
    split_head = False
    """The output head is split over the vocabulary (``plan.loss_parallel``): its logits are a
    DTensor split along their last dimension, which the loss takes inside torch's ``loss_parallel``."""

    def start(self, job: TrainJob, master_addr: str, master_port: int) -> None:
        """Join the process group: gloo for CPU workers, NCCL on this rank's current CUDA device
        (the worker selected it before, :func:`orch.launchers.gpu_worker.use_device`)."""
        import torch
        import torch.distributed as dist

        self.job = job
        if job.plan.accelerator.value == "gpu":
            self.device = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group("nccl", device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def build(self, job: TrainJob, coords: ParallelCoords) -> BuiltModel:
        """Build the model on ``meta`` on every rank, apply activation checkpointing, tensor
        parallelism and FSDP2 there, then allocate each rank's shards and fill them from the
        whole model that rank 0 alone builds from ``train.seed`` (:meth:`_fill_from_rank0`); then
        the optimizer and schedule. A node's host therefore holds the whole model once, not once
        per worker. A single rank builds whole and shards in place."""
        import torch
        from torch.distributed.fsdp import fully_shard

        from orch.launchers.engines.base import describe_optimizer
        from orch.launchers.engines.fsdp2.layout import (
            apply_tensor_parallel,
            context_parallel_text,
            enable_async_tp,
            fsdp_options,
            meshes,
            repeated_blocks,
            sequence_layout,
            split_head_text,
        )
        from orch.plans.model.meta import meta_device
        from orch.plans.parallel.vocab_parallel import output_head, splits_head

        plan = job.plan
        self.dtype = None if plan.precision.value == "fp32" else plan.precision.dtype
        if plan.pp > 1:
            return self._build_pipeline(job, coords)
        on_meta = self.world_size > 1
        torch.manual_seed(job.train.seed)
        with meta_device() if on_meta else contextlib.nullcontext():
            model = job.workload.model_factory()
        params_at_build = sum(p.numel() for p in model.parameters())
        if self.dtype is not None:
            cast_float_buffers(model, self.dtype)
        converted = 0
        if plan.precision.value == "fp8":
            from orch.launchers.engines.fsdp2.float8 import convert_blocks_to_fp8

            # torchtitan's order: convert, then tensor parallelism, recomputation, compile and FSDP2.
            converted = convert_blocks_to_fp8(repeated_blocks(model), plan, self.device)
        if plan.activation_checkpointing:
            from orch.plans.model.workload import enable_activation_checkpointing

            enable_activation_checkpointing(model, plan.activation_checkpointing, plan.recompute_every_n_layers)
        mesh = meshes(plan, self.device.type, coords)
        if mesh.cp is not None:
            from orch.launchers.engines.fsdp2.context import ContextSplit

            self.context = ContextSplit(mesh.cp)
        if mesh.tp is not None:
            head = output_head(model, job.workload.objective)
            self.split_head = splits_head(plan, head)
            apply_tensor_parallel(model, mesh.tp, job.workload.tp_layer_specs,
                                  sequence=sequence_layout(model, job.workload.tp_layer_specs) if plan.sequence_parallel
                                  else None, heads=[head] if self.split_head else [])
            if plan.async_tp:
                enable_async_tp(mesh.tp)
        options = fsdp_options(plan, mesh.dp)
        blocks = repeated_blocks(model)
        for block in blocks:
            if plan.compile:
                # torchtitan's order: tensor parallelism, recomputation, then compile each block
                # (in place: names and state dicts unchanged), and fully_shard around the compiled
                # block, whose gathers stay outside the graph.
                block.compile()
            fully_shard(block, **options)
        if plan.compile and not blocks:
            model.compile()  # nothing repeated to compile one at a time
        fully_shard(model, **options)
        if on_meta:
            self._fill_from_rank0(model, job)
        # The parameters fully_shard replaced are left in reference cycles (through their tensors'
        # C++ side); the worker builds with the collector paused and then freezes what survived
        # (orch.launchers.lean_startup), which would keep them for the whole run. One collection frees them.
        gc.collect()
        self._optimize(model, job)
        built = (f"on meta, fully_shard on {len(blocks)} blocks and the root, then filled from rank 0's whole build"
                 if on_meta else f"whole, then fully_shard on {len(blocks)} blocks and the root")
        if plan.compile:
            built += f", {'each block' if blocks else 'the model'} compiled (torch.compile)"
        if plan.sequence_parallel:
            built += f", the sequence split over the {plan.tp} tensor-parallel ranks"
        if plan.async_tp:
            built += ", its collectives overlapped with their matmuls (async TP)"
        if plan.precision.value == "fp8":
            built += f", {converted} linear layers multiplying in FP8 ({plan.fp8_recipe.value} scaling)"
        if plan.cp > 1:
            built += context_parallel_text(plan.cp)
        if self.split_head:
            built += split_head_text(head.name, head.embedding)
        return BuiltModel(built=built, params_at_build=params_at_build, params_on_rank=_local_numel(model),
                          optimizer=describe_optimizer(self.optimizer))

    def _optimize(self, model: Any, job: TrainJob) -> None:
        """The optimizer, schedule, clipping and loss scaling of ``model`` (wrapped and sharded)."""
        from orch.launchers.engines.fsdp2.torch_optim import build_optimizer, loss_scaler, lr_schedule
        from orch.plans.engine_settings import engine_settings

        self.model = model
        scaling = job.optim.loss_scaling
        # The planner counts the kernel's temporaries from the same settings (orch.plans.engines.fsdp2_memory).
        fused = engine_settings(job.plan, job.optim).fused_adam
        self.optimizer = build_optimizer(model.parameters(), job.optim, self.device.type, fused=fused)
        self.scheduler = lr_schedule(self.optimizer, job.optim.schedule)
        self.clip = job.optim.grad_clip
        self.scaler = loss_scaler(scaling, self.device.type) if scaling.enabled else None
        model.train()

    def _build_pipeline(self, job: TrainJob, coords: ParallelCoords) -> BuiltModel:
        """This rank's pipeline stages (:mod:`orch.launchers.engines.fsdp2.pipeline`), each built
        from its layers' own seeds, so no rank builds the whole model."""
        from orch.launchers.engines.base import describe_optimizer
        from orch.launchers.engines.fsdp2.layout import context_parallel_text, fsdp_options, meshes, split_head_text
        from orch.launchers.engines.fsdp2.pipeline import build_pipeline

        plan = job.plan
        if self.dtype is not None and plan.precision.value == "fp16":
            raise RuntimeError("plan.precision=fp16 with plan.pp > 1: the fsdp2 engine's pipeline trains in bf16 or "
                               "fp32 (no loss scaling across stages); set plan.precision=bf16")
        mesh = meshes(plan, self.device.type, coords)
        self.pipeline = build_pipeline(job, coords, self.device, mesh, fsdp_options(plan, mesh.dp))
        if self.dtype is not None:
            cast_float_buffers(self.pipeline.stages, self.dtype)
        gc.collect()
        self._optimize(self.pipeline.stages, job)
        held = sum(p.numel() for p in self.pipeline.stages.parameters())
        built = (f"stages {self.pipeline.stages.indices} of {self.pipeline.stages.layout.stages} "
                 f"({plan.pp_schedule.value}), each built from its layers' seeds, fully_shard on each block and stage")
        if plan.compile:
            built += ", each block compiled (torch.compile)"
        if plan.precision.value == "fp8":
            built += f", the blocks' linear layers multiplying in FP8 ({plan.fp8_recipe.value} scaling)"
        if plan.cp > 1:
            built += context_parallel_text(plan.cp)
        if self.pipeline.head is not None:
            built += split_head_text(self.pipeline.head.name, self.pipeline.head.embedding)
        return BuiltModel(built=built, params_at_build=held, params_on_rank=_local_numel(self.pipeline.stages),
                          optimizer=describe_optimizer(self.optimizer))

    def _fill_from_rank0(self, model: Any, job: TrainJob) -> None:
        """Allocate the sharded model built on ``meta`` and give it rank 0's weights.

        Rank 0 builds the whole model as a single rank would, from ``train.seed``;
        ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor to the other
        ranks, which keep their shard of it. Buffers the state dict leaves out (non-persistent:
        rotary frequencies, causal masks) are broadcast the same way, and so is rank 0's RNG state
        after its build, so that every rank goes on with the random stream a whole build leaves
        (dropout, sampling) as before.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = None
        if self.rank == 0:
            torch.manual_seed(job.train.seed)
            whole = job.workload.model_factory()
            if self.dtype is not None:
                cast_float_buffers(whole, self.dtype)
        model.to_empty(device=self.device)
        full = whole.state_dict() if whole is not None else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # The same buffers are left out on every rank (the module structure is the same);
        # checkpointing adds no wrapper module, so the names match the whole model's.
        whole_buffers = dict(whole.named_buffers()) if whole is not None else {}
        for name, buffer in _non_persistent_buffers(model):
            if self.rank == 0:
                buffer.copy_(whole_buffers[name])
            dist.broadcast(buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer, src=0)
        rng = torch.get_rng_state().to(self.device)
        dist.broadcast(rng, src=0)
        torch.set_rng_state(rng.cpu())

    def train_step(self, batches: Iterator[Any], milestone: Callable[[str], None]) -> float:
        """Forward and backward over ``plan.grad_accum_steps`` micro-batches, each loss scaled by
        their number (as DeepSpeed scales it); then clipping, the optimizer step and the schedule's
        step. Every micro-batch reduce-scatters its gradients into the sharded ones, as ZeRO-2/3
        do: skipping the sync (``set_requires_gradient_sync(False)``) would keep the whole
        model's unsharded fp32 gradients on every rank between micro-batches.

        In fp16 the loss is scaled dynamically; a step whose gradients overflowed is skipped on
        every rank, and the schedule does not advance, as in DeepSpeed.
        """
        micro = self.job.plan.grad_accum_steps
        if self.pipeline is not None:
            from orch.launchers.engines.fsdp2 import pipeline

            loss = pipeline.train_step(self.pipeline, batches, micro, self.to_device)
            milestone("pipeline")
            if self.clip > 0:
                clip_grad_norm(self.model.parameters(), self.clip, pp_group=self.pipeline.pp_group,
                               skip=self.pipeline.stages.duplicate_copies())
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            milestone("optimizer")
            return loss
        total = 0.0
        with self._step_context():
            for _ in range(micro):
                loss = self._loss(self.to_device(next(batches)))
                milestone("forward")
                scaled = loss / micro
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                milestone("backward")
                total += loss.item()
        if self.context is not None:
            total = self.context.mean(total)
        applied = True
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            clip_grad_norm(self.model.parameters(), self.clip)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale
        else:
            self.optimizer.step()
        if applied:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        milestone("optimizer")
        return total / micro

    @contextlib.contextmanager
    def _step_context(self) -> Iterator[None]:
        """What a forward and its backward run inside: attention spread over the context-parallel
        ranks (``plan.cp > 1``) and torch's ``loss_parallel`` when the head is split."""
        from orch.launchers.engines.fsdp2.layout import loss_context

        with contextlib.ExitStack() as stack:
            if self.context is not None:
                stack.enter_context(self.context.attention())
            stack.enter_context(loss_context(self.split_head))
            yield

    def _loss(self, batch: Any) -> torch.Tensor:
        """The training loss on ``batch``: on this rank's part of its sequence with ``plan.cp > 1``;
        a plain tensor (from split logits the loss is a replicated DTensor)."""
        if self.context is None:
            loss = self.job.workload.loss(self.model, batch)
        else:
            outputs, part = self.context.call(self.model, batch)
            loss = self.job.workload.objective(outputs, part)
        return whole_tensor(loss)

    def evaluate(self, val_batches: Iterator[Any], batches: int) -> dict[str, float]:
        if self.pipeline is not None:
            from orch.launchers.engines.fsdp2 import pipeline

            return pipeline.evaluate(self.pipeline, val_batches, batches, self.job.workload.objective,
                                     self.to_device)
        with self._step_context():
            found = mean_objective(self.model, self.job.workload.objective, val_batches, batches, self.to_device,
                                   run=self.context.call if self.context is not None else None)
        if self.context is None:
            return found
        return {name: self.context.mean(value) for name, value in found.items()}

    def outputs(self, batch: Any) -> Any:
        import torch

        from orch.plans.model.workload import call_model, output_tensor

        if self.pipeline is not None:
            raise RuntimeError("a pipelined model's outputs come from its last stage alone: not compared here")
        self.model.eval()
        try:
            with torch.no_grad():
                if self.context is None:
                    outputs = call_model(self.model, self.to_device(batch))
                    # Logits split over the vocabulary (plan.loss_parallel), gathered whole.
                    return whole_tensor(output_tensor(outputs)) if self.split_head else outputs
                with self.context.attention():
                    outputs, _ = self.context.call(self.model, self.to_device(batch))
                return self.context.whole(whole_tensor(output_tensor(outputs)))
        finally:
            self.model.train()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _own_state(self) -> dict[str, Any]:
        """Model and optimizer state under this rank's names; the optimizer's flattened
        (``state.<name>.<key>``), so a pipeline stage's part of it is keyed by parameter too."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model_state, "optimizer": optimizer_state}

    def _state(self) -> dict[str, Any]:
        """What is saved: the state under the whole model's names (a pipeline stage's renamed,
        :class:`orch.launchers.engines.fsdp2.pipeline_stages.StateNames`)."""
        state = self._own_state()
        if self.pipeline is not None:
            state = {part: self.pipeline.names.to_save(values) for part, values in state.items()}
        return state

    def save(self, root: str, tag: str, client_state: dict[str, Any]) -> None:
        """DCP's files of model and optimizer (each rank its shards) and, from rank 0, the loop's
        state with the schedule's (and fp16's loss scale) as JSON
        (:func:`orch.launchers.engines.fsdp2.dcp_files.write_client_state`)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from orch.launchers.engines.fsdp2.dcp_files import write_client_state

        folder = os.path.join(root, tag)
        dcp.save(self._state(), checkpoint_id=folder)
        if self.rank == 0:
            scaler = {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}
            write_client_state(folder, {**client_state, "scheduler": self.scheduler.state_dict(), **scaler})
        dist.barrier()

    def save_async(self, root: str, tag: str, client_state: dict[str, Any]) -> Callable[[], None]:
        """DCP's ``async_save``: the shards are copied to host memory now and written by a thread
        (its collectives on a gloo group of their own, apart from training's); rank 0 writes the
        loop's state at once. Returns the wait for the written files."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from orch.launchers.engines.fsdp2.dcp_files import write_client_state

        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        folder = os.path.join(root, tag)
        written = dcp.async_save(self._state(), checkpoint_id=folder, process_group=self._checkpoint_group)
        if self.rank == 0:
            scaler = {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}
            write_client_state(folder, {**client_state, "scheduler": self.scheduler.state_dict(), **scaler})
        return written.result

    def load(self, root: str, tag: str) -> dict[str, Any]:
        """Every file of the tag checked against its manifest first, then DCP's load, resharded to
        this run's layout; returns the loop's state (its tensors rebuilt from JSON)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from orch.launchers.engines.fsdp2.dcp_files import checked_metadata, load_checked, read_client_state
        from orch.launchers.manifest import verify

        folder = os.path.join(root, tag)
        verify(folder)
        checked_metadata(folder)  # refused here, by every rank, before DCP reads anything
        own = self._own_state()
        if self.pipeline is None:
            state = own
            load_checked(state, folder)
        else:
            names = self.pipeline.names
            state = {part: names.to_load(values) for part, values in own.items()}
            load_checked(state, folder)
            state = {part: names.loaded(list(own[part]), state[part]) for part in own}
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
        client_state = read_client_state(folder)
        self.scheduler.load_state_dict(client_state.pop("scheduler"))
        scaler = client_state.pop("grad_scaler", None)
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        return client_state

    def consolidated_state(self) -> dict[str, torch.Tensor] | None:
        """Every shard (FSDP and tensor-parallel) gathered into the model's own state dict, on CPU
        on rank 0; the names are the unwrapped model's (FSDP2 and the checkpointing keep them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel model is not consolidated: each stage holds other layers")
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None


def clip_grad_norm(parameters: Iterator[torch.nn.Parameter], max_norm: float, *, pp_group: Any = None,
                   skip: set[int] = frozenset()) -> float:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the norm.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one tensor, which fails
    when the parameters live on different meshes: with tensor parallelism the sharded layers are on
    the (dp, tp) mesh and the replicated ones (norms, embeddings) on the dp mesh alone. Each mesh's
    norm is reduced over its own ranks (``full_tensor``), then the squares are summed. A pipeline
    stage's squares are summed over the pipeline ranks (``pp_group``), each shared weight counted
    once: the copies in ``skip`` (ids) are left out of the norm, not out of the scaling.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    squares = 0.0
    for group in _by_mesh([p for p in params if id(p) not in skip]).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(norm) ** 2
    if pp_group is not None:
        device = grads[0].device if grads else torch.device("cpu")
        summed = torch.tensor(squares, dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=pp_group)
        squares = float(summed)
    total = squares ** 0.5
    if max_norm / (total + 1e-6) < 1.0:
        scale_gradients(params, max_norm, total)
    return total


def _by_mesh(params: list[torch.nn.Parameter]) -> dict[Any, list[torch.nn.Parameter]]:
    """The parameters with gradients, by their gradient's device mesh (None for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def scale_gradients(params: list[torch.nn.Parameter], max_norm: float, total: float) -> None:
    """Scale the gradients of ``params`` by ``max_norm / total`` with torch's own clipping, one foreach
    multiply per mesh's gradients (DTensors of different meshes cannot share one): a loop of
    per-gradient multiplies costs a DTensor dispatch each (bench/fsdp2_clip.py)."""
    import torch

    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, torch.tensor(total, dtype=torch.float64))


def _non_persistent_buffers(model: Any) -> list[tuple[str, Any]]:
    """The buffers a state dict leaves out (``register_buffer(..., persistent=False)``), by name."""
    return [(f"{prefix}.{name}" if prefix else name, buffer)
            for prefix, module in model.named_modules() for name, buffer in module.named_buffers(recurse=False)
            if name in module._non_persistent_buffers_set]


def _local_numel(model: torch.nn.Module) -> int:
    """Parameters this rank holds: the local shards of its DTensors."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
