"""DeepSpeed's engine behind the seam: ZeRO stages 0-3, offload, AutoTP tensor parallelism and
pipeline stages, with DeepSpeed's own checkpoints (universal ones to change layout)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from orch.launchers.engines.base import BuiltModel, Engine, cast_float_buffers, mean_objective
from orch.launchers.engines.deepspeed.building import (
    PipelineTensorGrid,
    build_model,
    forget_process_groups,
    import_deepspeed,
    mark_stage_parameters,
    ninja_on_path,
    pipeline_module,
    remember_pristine_groups,
    share_pipeline_groups_with_autotp,
    tensor_parallel_groups,
    unlink_shared_memory_buffers,
)
from orch.launchers.job import TrainJob
from orch.plans.parallel.rank_layout import ParallelCoords
from orch.plans.spec import Precision


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def start(self, job: TrainJob, master_addr: str, master_port: int) -> None:
        deepspeed = import_deepspeed()
        from deepspeed.utils import logger as ds_logger

        ninja_on_path()  # before init_distributed, which builds the CPU all-reduce on first use

        ds_logger.setLevel(logging.ERROR)  # progress is reported by the driver, not by every rank
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        # DeepSpeed's pipeline sends activations with in-place collectives on tensors autograd
        # tracks; its engine routes their gradients explicitly (and the loss curves match data
        # parallelism exactly), so torch's per-step warning about them says nothing to the user.
        warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
        self.job, self.plan = job, job.plan
        backend = "gloo" if self.plan.accelerator.value == "cpu" else "nccl"
        remember_pristine_groups()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        unlink_shared_memory_buffers(master_addr, master_port)
        import torch
        from deepspeed.accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())

    def build(self, job: TrainJob, coords: ParallelCoords) -> BuiltModel:
        import deepspeed
        import torch.distributed as dist

        from orch.launchers.engines.base import describe_optimizer
        from orch.launchers.engines.deepspeed.config import fused_adam_problem, without_fused_adam

        plan = self.plan
        if job.engine_config is None:
            raise ValueError("a TrainJob for plan.engine=deepspeed needs its DeepSpeed config in engine_config "
                             "(orch.launchers.engines.deepspeed.driver.engine_config)")
        built = "stages"
        if plan.pp > 1:
            module = pipeline_module(job)
            mpu = None  # the PipelineModule's own grid is the engine's mpu
            if plan.tp > 1:
                share_pipeline_groups_with_autotp(module)
        else:
            module, built = build_model(job)
            if plan.activation_checkpointing:
                from orch.plans.model.workload import enable_activation_checkpointing

                enable_activation_checkpointing(module, plan.activation_checkpointing, plan.recompute_every_n_layers)
            mpu = tensor_parallel_groups(job, dist.get_rank(), coords)
        full_numel = sum(p.numel() for p in module.parameters())
        # What this rank holds right after construction (ZeRO-3 partitions: only its share).
        held_at_build = full_numel if plan.zero_stage != 3 else sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
        # With plan.tp > 1 the config's tensor_parallel section makes initialize() shard the model
        # (AutoTP) before ZeRO wraps it; the parameter generator is read after that, so the
        # optimizer gets the shards.
        ds_config, optimizer_note = job.engine_config, None
        fallback = without_fused_adam(job.engine_config) if plan.accelerator.value == "gpu" else job.engine_config
        if fallback is not job.engine_config and (problem := fused_adam_problem()):
            ds_config = fallback
            optimizer_note = f"torch's fused AdamW (DeepSpeed's FusedAdam: {problem})"
        self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                    config=ds_config, mpu=mpu)
        self.device = self.engine.device
        self.dtype = None if plan.precision == Precision.fp32 else plan.precision.dtype
        if self.dtype is not None:
            cast_float_buffers(module, self.dtype)
        if plan.pp > 1:
            mark_stage_parameters(module, coords)
        if plan.pp > 1 and plan.tp > 1:
            # AutoTP set the engine's mpu to deepspeed.utils.groups, which knows no pipeline;
            # the pipeline engine asks its mpu for the pipe group every step.
            self.engine.mpu = PipelineTensorGrid(self.engine.grid)
            # The checkpoint's model-parallel rank and size were fixed during initialize() from
            # the tensor-parallel group alone: the stages' tp rank 0 would all write one and the
            # same ZeRO file. The pipe x tensor group tells them apart, as without AutoTP.
            self.engine.checkpoint_mp_rank = self.engine.grid.get_model_parallel_rank()
            self.engine.mp_world_size = self.engine.grid.get_model_parallel_world_size()
        self.engine.train()
        on_rank = sum(p.numel() for p in module.parameters())
        if plan.tp > 1 and on_rank == full_numel:
            raise RuntimeError(f"plan.tp={plan.tp}, but no layer of {type(module).__name__} matched the "
                               "tensor-parallel layer specs: every rank would hold and compute the whole model")
        return BuiltModel(built=built, params_at_build=held_at_build, params_on_rank=on_rank,
                          optimizer=describe_optimizer(self.engine.basic_optimizer), optimizer_note=optimizer_note)

    def train_step(self, batches: Iterator[Any], milestone: Callable[[str], None]) -> float:
        if self.plan.pp > 1:
            # One call runs every micro-batch through the stages (DeepSpeed's 1F1B schedule) and
            # steps the optimizer; the loss comes back to every stage, averaged.
            loss = self.engine.train_batch(data_iter=batches).item()
            for _ in range(3):
                milestone("pipeline")
            return loss
        total = 0.0
        for _ in range(self.plan.grad_accum_steps):
            loss = self.job.workload.loss(self.engine, self.to_device(next(batches)))
            milestone("forward")
            self.engine.backward(loss)
            milestone("backward")
            self.engine.step()  # the optimizer steps at the last micro-batch only
            milestone("optimizer")
            total += loss.item()
        return total / self.plan.grad_accum_steps

    def evaluate(self, val_batches: Iterator[Any], batches: int) -> dict[str, float]:
        if self.plan.pp > 1:
            # The last stage computes the loss; DeepSpeed averages it over the micro-batches and
            # the data-parallel replicas and broadcasts it to every stage.
            loss = self.engine.eval_batch(val_batches, num_micro_batches=batches)
            self.engine.train()
            return {"loss": loss.item()}
        return mean_objective(self.engine, self.job.workload.objective, val_batches, batches, self.to_device)

    def outputs(self, batch: Any) -> Any:
        import torch

        from orch.plans.model.workload import call_model

        self.engine.eval()
        with torch.no_grad():
            outputs = call_model(self.engine, self.to_device(batch))
        self.engine.train()
        return outputs

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, root: str, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)

    def save_async(self, root: str, tag: str, client_state: dict[str, Any]) -> Callable[[], None]:
        """DeepSpeed's own ``save_checkpoint``, its files copied to host memory in the step and
        written by a thread (:mod:`orch.launchers.engines.deepspeed.background_save`)."""
        from orch.launchers.engines.deepspeed.background_save import host_copies, write_in_background

        with host_copies(self.engine) as copying:
            self.engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
        return write_in_background(copying.configured, copying.queued)

    def load(self, root: str, tag: str) -> dict[str, Any]:
        import os

        from orch.launchers.engines.deepspeed.checkpoint_files import ds_verified_loading, weights_only_loading

        # A checkpoint file must not be able to run code, and must be the one its manifest lists.
        folder = os.path.join(root, tag)
        if self.engine.load_universal_checkpoint():
            # DeepSpeed reads universal checkpoints past the checkpoint engine, with torch.load itself.
            with ds_verified_loading(folder):
                _, client_state = self.engine.load_checkpoint(root, tag=tag)
        else:
            with weights_only_loading(self.engine, folder):
                _, client_state = self.engine.load_checkpoint(root, tag=tag)
        if client_state is None:
            raise RuntimeError(f"checkpoint {tag} in {root} could not be loaded")
        return client_state

    def consolidated_state(self):
        """ZeRO-3 gathers every partition and tensor parallelism every AutoTP shard (all ranks call
        this, through DeepSpeed's consolidation for either); the other plans hold the whole model
        on every rank already. Pipeline stages hold different layers under the pipeline's own
        names and are not put together here."""
        import torch.distributed as dist

        if self.plan.pp > 1:
            raise RuntimeError("a pipeline-parallel model is not consolidated: each stage holds other layers")
        if self.plan.zero_stage == 3 or self.plan.tp > 1:
            state = self.engine._consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict()
        if dist.get_rank() != 0:
            return None
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}

    def shutdown(self) -> None:
        """Release the engine (DeepSpeed's ``destroy``: its optimizer's gradient hooks, which hold
        the optimizer's flat buffers through autograd's C++ nodes where Python's collector cannot
        free them), leave the process group, and empty DeepSpeed's caches of it
        (:func:`forget_process_groups`). A worker reused for another run starts from nothing."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
            self.engine = None
        super().shutdown()
        forget_process_groups()
