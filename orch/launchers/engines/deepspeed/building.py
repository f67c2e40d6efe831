"""How DeepSpeed's engine gets its model: whole, under ``zero.Init``, or as pipeline stages, and
the process groups DeepSpeed's tensor parallelism (AutoTP) and pipeline engine must share."""

from __future__ import annotations

import importlib
import os
import sys

from orch.launchers.job import TrainJob
from orch.plans.parallel.rank_layout import GRID_AXES, ParallelCoords
from orch.plans.parallel.stage_layers import StageLayer


def import_deepspeed():
    """``import deepspeed``, leaving out the MLflow import its autotuner makes on the way.

    ``import deepspeed`` imports ``deepspeed.autotuning``, which imports MLflow whenever it is
    installed (it always is with orch) to log autotuning experiments. Training ranks never run
    DeepSpeed's autotuner, and MLflow's import is most of ``import deepspeed``'s time. A ``None`` in
    ``sys.modules`` makes that one import fail, which DeepSpeed expects (MLflow is optional to it);
    the entry is removed again, so the model's or the objective's own ``import mlflow`` works.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # the import system's documented way to make an import fail
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


_PRISTINE_GROUPS: dict[str, type] | None = None
"""The names of ``deepspeed.utils.groups``' empty caches before this process first joined a process
group, with the type each starts as (``dict`` or ``None``)."""


def remember_pristine_groups() -> None:
    """Note DeepSpeed's empty process-group caches, once per process, before it first fills them."""
    global _PRISTINE_GROUPS
    if _PRISTINE_GROUPS is None:
        from deepspeed.utils import groups

        _PRISTINE_GROUPS = {name: type(value) for name, value in vars(groups).items()
                            if not name.startswith("__") and (value is None or (type(value) is dict and not value))}


def forget_process_groups() -> None:
    """Empty the caches in which DeepSpeed keeps its process groups and its communication backend.

    They are module globals (``deepspeed.comm.comm.cdb``, the world, data, expert and tensor
    parallel groups of ``deepspeed.utils.groups``) and outlive ``destroy_process_group``: the next
    run of a reused process (:mod:`orch.launchers.worker_pool`) would be handed groups of a process
    group that is gone. Emptied, DeepSpeed builds them anew, as in a new process.
    """
    if _PRISTINE_GROUPS is None:
        return
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    for name, kind in _PRISTINE_GROUPS.items():
        setattr(groups, name, {} if kind is dict else None)


def ninja_on_path() -> None:
    """Put this interpreter's scripts directory first on PATH when ``ninja`` is there.

    DeepSpeed compiles its C++ ops (CPU Adam, the CPU all-reduce, fused Adam on GPUs) on first
    use, and torch runs whichever ``ninja`` PATH finds to build them. pip installs the ``ninja``
    DeepSpeed requires beside the interpreter, which is on PATH only in an activated environment:
    ``.venv/bin/orch`` run without activating it would build with another ninja, or fail without
    one ("Ninja is required to load C++ extensions"). A ninja of another version also hashes its
    build commands differently, so each would rebuild what the other built, a minute or more per op.
    """
    scripts = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(scripts, "ninja")):
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != scripts:
        os.environ["PATH"] = os.pathsep.join([scripts, path]) if path else scripts


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


def _import_module_of(dotted: str) -> None:
    """Import the longest importable module prefix of a dotted ``_target_`` path."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
            return
        except ImportError:
            continue


def build_model(job: TrainJob):
    """The model, and how it was built.

    Under ZeRO-3 it is built inside ``deepspeed.zero.Init``: each rank allocates only its
    partition of every parameter as it is created, so no rank ever holds the whole model. That
    needs a model that initializes each parameter inside the module that owns it (Hugging Face
    models and the built-in GPT do); one that initializes a submodule's weights from its parent
    after the submodule is built (torchvision's ViT does) fails there, and is built whole instead.
    """
    if job.plan.zero_stage == 3 and job.plan.pp == 1 and job.plan.tp == 1:
        from orch.launchers.engines.deepspeed.zero_init import zero3_build
        from orch.plans.model.meta import meta_device

        # zero.Init patches tensor construction; a library imported for the first time inside it
        # fails (torchvision registers tensor subclasses at import; transformers imports a model's
        # module, and through it torch._dynamo, at the model's first construction). So the model's
        # module comes first, then one build on meta, which imports whatever building it imports.
        _import_module_of(job.workload.model_config.get("_target_", ""))
        with meta_device():
            job.workload.model_factory()
        try:
            with zero3_build(job.engine_config):
                return job.workload.model_factory(), "zero.Init"
        except Exception as error:  # noqa: BLE001 - the model's own code, run under zero.Init
            reason = f"zero.Init failed: {type(error).__name__}: {error}"
            refuse_whole_build_beyond_memory(job, reason)
            return job.workload.model_factory(), f"whole ({reason})"
    return job.workload.model_factory(), "whole"


def refuse_whole_build_beyond_memory(job: TrainJob, reason: str) -> None:
    """Stop, with the reason, before building whole a model that the node's free memory cannot hold.

    The planner counted this rank's zero.Init share; a model whose code cannot run under
    zero.Init is built whole instead, by every local worker at once. Its size comes from a build
    on ``meta`` (no memory); the free memory is divided among the node's workers.
    """
    import psutil

    from orch.plans.memory.states import model_stats
    from orch.plans.model.meta import meta_device

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


def pipeline_module(job: TrainJob):
    """The model as DeepSpeed pipeline stages; this rank builds only its own stage's layers.

    The grid is ours (:func:`orch.plans.parallel.rank_layout.parallel_coords`, axes :data:`GRID_AXES`), handed
    to DeepSpeed as a ``ProcessTopology``, so the stage, replica and data shard of every rank are
    what ``orch check`` showed. With activation checkpointing each layer with parameters is
    recomputed in backward (``activation_checkpoint_interval=1``), with torch's non-reentrant
    checkpoint as the model's own switch uses (selective: under the same policy).
    """
    import functools

    import torch.utils.checkpoint
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    from orch.plans.model.workload import checkpoint_kwargs

    plan = job.plan
    if job.workload.pipeline_layers is None:
        raise RuntimeError(f"plan.pp={plan.pp} but the job carries no pipeline layers for the model")
    recompute = {}
    if plan.activation_checkpointing:
        recompute = {"activation_checkpoint_interval": 1,
                     "activation_checkpoint_func": functools.partial(
                         torch.utils.checkpoint.checkpoint, **checkpoint_kwargs(plan.activation_checkpointing))}
    topology = ProcessTopology(axes=list(GRID_AXES), dims=[plan.dp, plan.pp, plan.tp])
    objective = job.workload.objective

    def loss_fn(outputs, targets):
        # DeepSpeed's pipeline hands the last stage the batch's targets alone.
        return objective(outputs, (None, targets))

    return PipelineModule(layers=deepspeed_layers(job.workload.pipeline_layers()), topology=topology,
                          loss_fn=loss_fn, partition_method=plan.pp_partition, **recompute)


def deepspeed_layers(layers: list) -> list:
    """The model's :class:`~orch.plans.parallel.stage_layers.StageLayer` list as DeepSpeed's pipeline layers.

    A tied layer becomes a ``TiedLayerSpec`` under its tie key, any other a ``LayerSpec``. Anything
    else in the list (DeepSpeed ``LayerSpec`` objects or modules, which a model of its own may still
    return from ``pipeline_layers()``) is DeepSpeed's already and passes through unchanged.
    """
    import torch
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    converted = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, StageLayer):
            converted.append(layer)
            continue
        if not (isinstance(layer.module, type) and issubclass(layer.module, torch.nn.Module)):
            raise TypeError(f"pipeline layer {index} ({layer.name}) is built by a function, and DeepSpeed's "
                            "pipeline builds layers from nn.Module classes only: give the StageLayer the "
                            "module's class")
        if layer.tie is None:
            converted.append(LayerSpec(layer.module, *layer.args, **layer.kwargs))
        else:
            attr = layer.tied_weight_attr
            converted.append(TiedLayerSpec(layer.tie, layer.module, *layer.args, forward_fn=layer.forward_fn,
                                           tied_weight_attr=attr if isinstance(attr, str) else list(attr),
                                           **layer.kwargs))
    return converted


def mark_stage_parameters(module, coords: ParallelCoords) -> None:
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


def share_pipeline_groups_with_autotp(module) -> None:
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


def tensor_parallel_groups(job: TrainJob, rank: int, coords: ParallelCoords):
    """DeepSpeed's tensor- and data-parallel groups, built before ``deepspeed.initialize`` (None at tp=1).

    initialize() would build the same groups itself, but only after it has checked the batch
    sizes against the world size, counting every rank as a data-parallel replica: with the
    groups passed as ``mpu`` it counts dp ranks only, so ``train_batch_size`` stays
    micro × accumulation × dp. The layout is ours (:func:`parallel_coords`); a DeepSpeed
    that grouped ranks differently would feed one tensor-parallel group different data.
    """
    if job.plan.tp == 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=job.plan.tp)
    theirs = (groups.get_data_parallel_rank(), groups.get_tensor_model_parallel_rank())
    if theirs != (coords.dp_rank, coords.tp_rank):
        raise RuntimeError(f"rank {rank}: DeepSpeed placed it at (dp_rank, tp_rank) = {theirs}, "
                           f"the orchestrator at {(coords.dp_rank, coords.tp_rank)}")
    return groups


class PipelineTensorGrid:
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
