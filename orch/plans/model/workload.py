"""The user's workload as the planner, the tuner and the workers all take it.

A workload is resolved once from the config (``orch/workload.py``) into a
:class:`Workload`: the model factory, the objective, the data source, the tensor-parallel layer
specs and the pipeline layers. Nothing here knows what kind of model it is: a batch is whatever
the data source yields, and the objective turns ``(outputs, batch)`` into a loss.

The calling convention is Hugging Face's: a dict batch is passed as keyword arguments
(``model(**batch)``), an ``(inputs, targets, ...)`` sequence as ``model(inputs)``, and a lone
tensor as ``model(tensor)``. Whatever the model returns is accepted: a tensor, a tuple (its
first item is the output) or a ``ModelOutput`` (``.logits``, or ``.loss`` when the model
computed it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.overrides import TorchFunctionMode

from orch.plans.errors import Violation
from orch.plans.spec import Recompute

Batch = Any
"""A micro-batch as the data source yields it: a tensor, a sequence ``(inputs, targets, ...)``
or a mapping of named tensors."""

PROBE_SAMPLES = 2
"""Samples in the batch the planner counts per-sample costs from: one sample would make a
BatchNorm in training mode refuse the batch (it needs two values per channel)."""


def call_model(module: torch.nn.Module, batch: Batch, **extra: Any) -> Any:
    """Run ``module`` on ``batch`` the way Hugging Face code expects; ``extra`` keyword arguments
    (a part of the sequence's ``position_ids``) go with it."""
    if isinstance(batch, Mapping):
        return module(**batch, **extra)
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return module(batch[0], **extra)
    return module(batch, **extra)


def output_tensor(outputs: Any) -> torch.Tensor:
    """The prediction a model returned: the tensor itself, ``.logits`` of a ``ModelOutput``, or
    the first item of a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    if isinstance(outputs, Sequence) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(f"the model returned {type(outputs).__name__}; return a tensor, a tuple whose first item is "
                    "the output, or a ModelOutput with .logits")


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss the model computed itself (a ``ModelOutput``'s ``.loss``), if any."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def batch_targets(batch: Batch) -> torch.Tensor | None:
    """The targets a batch carries: ``batch["labels"]`` of a dict, the second item of a sequence."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and len(batch) > 1:
        return batch[1]
    return None


def move_batch(batch: Batch, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
    """``batch`` with every tensor in it on ``device`` (structure kept), and its floating-point
    tensors in ``dtype`` when given: a model trained in bf16 takes bf16 images, while token ids and
    labels stay integers."""
    def move(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        return tensor.to(device=device, dtype=cast)

    return map_tensors(batch, move)


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """``batch`` with ``fn`` applied to every tensor in it (dicts, lists and tuples kept as they are)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


@runtime_checkable
class Objective(Protocol):
    """``(outputs, batch) -> scalar loss``; the same callable in training, the pipeline's
    ``loss_fn``, eval, and the planner's measurements on ``meta``.

    An objective may also offer ``metrics(outputs, batch) -> dict[str, torch.Tensor]`` (scalar
    tensors averaged over eval batches and ranks, e.g. accuracy) and ``name`` (a short label).
    """

    def __call__(self, outputs: Any, batch: Batch) -> torch.Tensor: ...


@runtime_checkable
class DataSource(Protocol):
    """Where the batches come from. Instances are light (paths and settings): built in the
    driver, checked there, and pickled to the workers, which open the data themselves.

    Every source yields map-style ``torch.utils.data.Dataset`` objects; the workers shard them
    over data-parallel replicas (the ranks of one tensor-parallel group read the same batch) and
    save their position in checkpoints.
    """

    tokens_per_sample: int | None
    """Tokens in one sample, for throughput in tokens/s (None: samples/s only)."""
    required_outputs: int | None
    """The smallest last output dimension a model must have for this data (vocabulary for token
    ids, class count for labels); None: no such requirement."""

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        """Everything wrong with the declared data, found without opening more than needed;
        checked before any worker starts. Both splits must hold ``samples_per_step`` samples (a
        plan's step draws ``dp * micro_batch_size``). Field names are given as ``data.<field>``."""
        ...

    def sizes(self) -> tuple[int, int]:
        """Samples in the training and the evaluation split (cheap where possible)."""
        ...

    def example_batch(self, batch_size: int) -> Batch:
        """A micro-batch of ``batch_size`` samples on the ``meta`` device: the shapes and dtypes
        the planner measures the model with; nothing is read."""
        ...

    def prepare(self) -> None:
        """Build any on-disk cache (e.g. tokenization) once; safe to call from every rank at once."""
        ...

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """The training and the evaluation split, opened in the worker."""
        ...

    def collate(self) -> Callable[[list], Batch] | None:
        """How samples become a batch; None: torch's default collation."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the run's MLflow dataset input records: ``name``, ``source`` (a path, a list of
        paths, or a Python target), ``size`` in ``unit`` (bytes, images, samples) and ``digest``
        (hex; the same data gives the same digest), plus any settings worth showing."""
        ...


@runtime_checkable
class StreamingSource(DataSource, Protocol):
    """A data source too large to open as a map-style dataset in every worker: it is streamed.

    The driver asks it for one ``(training, evaluation)`` pair of streams per data-parallel
    replica, for each attempt of the worker group; each replica's first rank reads its pair and
    passes the batches to the replica's other ranks. ``datasets()`` is not used.
    """

    cpus: float
    """CPUs the source's own tasks need beside the workers' (an embedded Ray adds them)."""
    shuffle_buffer: int
    """Samples each replica shuffles among locally, reseeded every epoch; 0: stream order."""

    def streams(self, dp: int, eval_samples: int) -> list[tuple[Any, Any]]:
        """One ``(training, evaluation)`` stream pair per replica, of equal lengths; the
        evaluation streams hold the held-out split's first ``eval_samples`` samples."""
        ...

    def to_batch(self) -> Callable[[dict], Batch]:
        """How one streamed micro-batch (a dict of column tensors) becomes the model's batch."""
        ...


def data_task_cpus(data: DataSource) -> float:
    """CPUs a run needs beside its workers' for the data's own tasks (0 for a map-style source)."""
    return data.cpus if isinstance(data, StreamingSource) else 0.0


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The user's workload, resolved once; picklable, so the workers get the same object."""

    model_factory: Callable[[], torch.nn.Module]
    """Builds the model (on ``meta`` in the planner, for real in the workers)."""
    objective: Objective
    data: DataSource
    model_config: dict = field(default_factory=dict)
    """The model's declared config (``_target_`` and arguments): errors name its keys."""
    tp_layer_specs: list[dict] | None = None
    """DeepSpeed AutoTP layer specs (``{patterns, partition_type, ...}``) that shard this model;
    None: it cannot be tensor-parallel."""
    tp_specs_source: str | None = None
    """Where the specs came from (model.tp_layer_specs, the model's own tp plan, a DeepSpeed preset)."""
    pipeline_layers: Callable[..., list] | None = None
    """The model's pipeline layers in forward order (:class:`orch.plans.parallel.stage_layers.StageLayer`, or
    DeepSpeed ``LayerSpec`` objects); None: it cannot be pipelined."""
    pipeline_refusal: str | None = None
    """Why the model cannot be pipelined, when it cannot."""
    weight_file_bytes: int = 0
    """Bytes of the weight files the model's constructor reads from local paths in its arguments
    (a ``save_pretrained`` directory, a state dict): held beside the built model while it loads."""

    def loss(self, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The training loss of ``module`` on ``batch``."""
        return self.objective(call_model(module, batch), batch)

    def example_batch(self, batch_size: int) -> Batch:
        """A micro-batch on ``meta``, as the data source shapes it."""
        return self.data.example_batch(batch_size)

    @property
    def tokens_per_sample(self) -> int | None:
        return self.data.tokens_per_sample


class ModelInputs(Protocol):
    """What the planner runs a model on: a :class:`Workload`, or anything with these three."""

    tokens_per_sample: int | None
    objective: Objective

    def example_batch(self, batch_size: int) -> Batch: ...


def batch_bytes(batch: Batch) -> int:
    """Bytes of every tensor in a batch (meta tensors included: their sizes are known)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, Mapping):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(v) for v in batch)
    return 0


def checkpoint_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks a model recomputes one at a time under activation checkpointing.

    The items of its ``ModuleList``s: the transformer blocks that the built-in GPT's and Hugging
    Face's own ``gradient_checkpointing_enable()`` checkpoint one ``checkpoint`` call each. A model
    without them (torchvision's ResNets and ViT) keeps its blocks in ``Sequential``s of one block
    class: the outermost such ``Sequential`` of at least two non-leaf blocks gives its items
    (a ResNet stage's bottlenecks, a ViT encoder's layers).
    """
    listed = [layer for m in module.modules() if isinstance(m, torch.nn.ModuleList) for layer in m]
    if listed:
        return listed
    units: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, torch.nn.Sequential) or len(m) < 2:
            continue
        if len({type(block) for block in m}) == 1 and all(next(block.children(), None) is not None for block in m):
            units += list(m)
            inside.update(id(sub) for block in m for sub in block.modules())
    return units


def supports_activation_checkpointing(module: torch.nn.Module) -> bool:
    """The model has its own switch, or blocks :func:`enable_activation_checkpointing` can wrap."""
    return callable(getattr(module, "gradient_checkpointing_enable", None)) or bool(checkpoint_units(module))


def saved_ops() -> list:
    """The ops selective recomputation keeps the outputs of: the matmuls, attention and convolutions,
    which are the FLOPs (the ops ``torch.utils.flop_counter`` counts). Everything else in a block
    (norms, activations, dropout, residual adds, reshapes) is recomputed in backward: cheap in time,
    and most of a block's activation bytes. Collectives are recomputed too (a tensor-parallel
    block's all-reduce runs again, as under full recomputation)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return [getattr(aten, name).default for name in names if hasattr(aten, name)]


def checkpoint_kwargs(recompute: str) -> dict[str, Any]:
    """``torch.utils.checkpoint.checkpoint``'s keyword arguments for a recomputation policy
    (``full`` or ``selective``: :class:`orch.plans.spec.Recompute`, by value). Selective runs
    under torch's selective-checkpoint contexts with :func:`saved_ops`, and the outputs it keeps
    pass through any ``saved_tensors_hooks`` around them, as everything else autograd saves does
    (the planner counts saved tensors with such a hook)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs: dict[str, Any] = {"use_reentrant": False}
    if Recompute.of(recompute) is Recompute.selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, saved_ops())
        kwargs["respect_saved_tensors_hooks"] = True
    return kwargs


def selective_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot recompute selectively, or None: its own checkpointing switch must take
    checkpoint arguments (Hugging Face's ``gradient_checkpointing_kwargs``, which the built-in GPT
    shares); a model without a switch has its blocks wrapped here, which always can."""
    import inspect

    switch = getattr(module, "gradient_checkpointing_enable", None)
    if not callable(switch):
        return None
    try:
        parameters = inspect.signature(switch).parameters
    except (TypeError, ValueError):
        return None
    if "gradient_checkpointing_kwargs" in parameters:
        return None
    return (f"{type(module).__name__}.gradient_checkpointing_enable() takes no checkpoint arguments "
            "(gradient_checkpointing_kwargs), so it cannot be told what to keep")


def enable_activation_checkpointing(module: torch.nn.Module, recompute: str = "full", every_n_layers: int = 1) -> None:
    """Recompute activations in backward instead of saving them: every block's (``full``), or all
    but its matmuls' and attention's outputs (``selective``, :func:`checkpoint_kwargs`); with
    ``every_n_layers`` > 1 only in blocks 0, n, 2n, ... (the others keep their activations).

    Through the model's own switch (Hugging Face's name, which the built-in GPT shares) when it
    has one (and, for ``every_n_layers`` > 1, takes Hugging Face's ``every_n_layers``); otherwise
    each of its :func:`checkpoint_units` runs under ``torch.utils.checkpoint`` (non-reentrant), the
    way torchtitan and FSDP's ``checkpoint_wrapper`` wrap blocks, but without a wrapper module, so
    parameter names (and checkpoints, tensor-parallel patterns) are unchanged.
    """
    policy = Recompute.of(recompute)
    if not policy:
        return
    selective = policy is Recompute.selective
    switch = getattr(module, "gradient_checkpointing_enable", None)
    if callable(switch) and (every_n_layers == 1 or _takes(switch, "every_n_layers")):
        every = {"every_n_layers": every_n_layers} if every_n_layers > 1 else {}
        if not selective:
            switch(**every)
            return
        if problem := selective_problem(module):
            raise ValueError(problem)
        switch(gradient_checkpointing_kwargs=checkpoint_kwargs(recompute), **every)
        return
    units = checkpoint_units(module)
    if not units:
        raise ValueError(f"{type(module).__name__} has no gradient_checkpointing_enable() and no repeated blocks "
                         "(ModuleList items, or a Sequential of blocks of one class) to checkpoint")
    checkpoint_blocks(units, recompute, every_n_layers)


def _takes(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` takes a keyword argument ``name``."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def checkpoint_blocks(units: list[torch.nn.Module], recompute: str = "full", every_n_layers: int = 1) -> None:
    """Run ``units`` 0, n, 2n, ... (n: ``every_n_layers``) under ``torch.utils.checkpoint`` with the
    ``recompute`` policy, in place (no wrapper module: names unchanged). A pipeline rank's blocks
    (of all its stages) are checkpointed so, counted from its first."""
    kwargs = checkpoint_kwargs(recompute)
    for unit in units[::every_n_layers]:
        unit.forward = _Checkpointed(unit.forward, kwargs)


class _Checkpointed:
    """A block's forward run under ``torch.utils.checkpoint`` while gradients are recorded."""

    def __init__(self, forward: Callable[..., Any], checkpoint_kwargs: dict[str, Any]):
        self.forward = forward
        self.checkpoint_kwargs = checkpoint_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, **self.checkpoint_kwargs, **kwargs)


class MetaBranches(TorchFunctionMode):
    """Take a branch on a meta tensor's value as true, instead of failing.

    A meta tensor has no value, so ``if (mask == 0).all():`` cannot be decided on it. The planner
    takes the true branch, the outcome of the checks models make on ordinary data: Hugging Face's
    causal LMs ask whether the positions hold packed sequences, and a plain batch does not.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return True
        return func(*args, **(kwargs or {}))
