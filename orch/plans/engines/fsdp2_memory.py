"""How many bytes one rank of an FSDP2 plan needs, part by part, as PyTorch's ``fully_shard`` lays them out.

The FSDP2 engine calls ``fully_shard`` on each repeated block of the model (the blocks activation
checkpointing recomputes: :func:`orch.plans.model.workload.checkpoint_units`) and then on the root, which
keeps what no block owns (embeddings, the head, final norms). What each rank holds follows
torch/distributed/fsdp/_fully_shard/ (torch 2.14):

* **sharded parameters**: every parameter is a DTensor sharded on dim 0 over the shard group
  (``_fsdp_param.py``, ``FSDPParam._init_sharded_param``), in its own dtype: fp32 for a model
  built in fp32. ``MixedPrecisionPolicy.param_dtype`` only casts the *gathered* copy
  (``_fsdp_api.py``: "FSDP ... keeps the high-precision sharded parameters in memory anyway"), so
  the sharded fp32 parameters are the optimizer's master weights and no separate master exists.
* **optimizer states**: torch's optimizer steps the sharded parameters: Adam's two fp32 moments of
  the rank's shard.
* **sharded gradients**: reduce-scattered in ``reduce_dtype`` (fp32) and cast to the sharded
  parameter's dtype (``_fsdp_collectives.py``, ``foreach_reduce``: ``_to_dtype_if_needed(...,
  orig_dtype)``), so fp32 and 1/N of the trainable parameters; they accumulate over the
  micro-batches of a step and are freed by ``zero_grad``.
* **gathered blocks in flight**: ``foreach_all_gather`` allocates one flat buffer of a block's
  parameters in the compute dtype and ``foreach_all_gather_copy_out`` copies it into the block's
  unsharded parameters. In forward the flat buffer is kept until the next block's copy-out
  (``FSDPParamGroup.wait_for_unshard``, "defer free to allow for overlap"), and on GPUs the next
  block's all-gather is prefetched while the current one computes; in backward
  ``_backward_prefetch`` gathers the previous block while the current one runs. Either way a
  block's unsharded parameters and one more block-sized buffer are alive. A single-rank shard
  group copies the parameters without a flat buffer.
* **without reshard_after_forward** (``FSDPParamGroup.reshard`` returns early in forward) every
  block keeps its gathered parameters from its forward until its backward: at the end of forward
  all blocks are gathered at once.
* **the root**: torch keeps the root gathered after forward only when ``reshard_after_forward``
  is left at its ``None`` default (``FSDPState._lazy_init``); the engine passes the plan's
  setting to the root as well, so with ``true`` the root reshards when its forward ends and
  gathers again in the hook on the gradient of its output. The loss's backward, where the
  activations peak with the output's gradients, meets no root parameters; from the head's
  backward on they are gathered to the end of backward, and their gradients (the head's first)
  wait in ``.grad`` for the root's reduce-scatter at the very end. With ``false`` the root stays
  gathered throughout.
* **one block's gradients before its reduce-scatter**: autograd leaves the block's unsharded
  gradients in the compute dtype; ``foreach_reduce`` copies them into a ``reduce_dtype`` (fp32)
  reduce-scatter input of the whole block before freeing them, so both coexist at the copy-in;
  the previous block's input and output stay alive until the next reduce-scatter
  (``reduce_scatter_states``, at most one kept).
* **gradient accumulation**: the engine reduce-scatters every micro-batch (no
  ``set_requires_gradient_sync(False)``), so what earlier micro-batches leave is the sharded fp32
  gradients, not the unsharded ones.
* **CPU offload** (``CPUOffloadPolicy``): the sharded parameters, gradients and optimizer states
  live in host memory; the device keeps only what is gathered for compute.
* **HSDP** (``plan.fsdp.hybrid``): the shard group is the data-parallel ranks of one node
  (:func:`orch.plans.engine_settings.fsdp_mesh`); nodes hold replicas.

Activations are measured on ``meta`` exactly as for DeepSpeed (:mod:`orch.plans.memory.activations`), with
the trace cut where backward enters and leaves the repeated layers: these parts are alive at
different moments, and each phase below pairs them with the activations of its moment (the
loss's backward, the head's, the first block backward reaches, the blocks after it, the last
block's reduce-scatter). The peak is what is held plus the worst phase, as
:func:`orch.plans.memory.states.step_phases` counts DeepSpeed's.
Notation: Ψ parameters, Φ trainable ones, N the shard group, b the compute dtype's bytes, B the
largest block, R the root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from orch.plans.engine_settings import EngineSettings
from orch.plans.memory.activations import ActivationBytes
from orch.plans.memory.states import DevicePhases, ModelStateBytes, ModelStats, PhaseBytes, _optimizer_moment_bytes
from orch.plans.model.workload import checkpoint_units
from orch.plans.spec import Offload, OptimizerName, Precision

if TYPE_CHECKING:
    from orch.plans.resolve import ResolvedPlan

_FP32 = 4
"""Bytes of the sharded parameters and gradients (a model built in fp32) and of the fp32 reduction."""


@dataclass(frozen=True, kw_only=True)
class FSDPMesh:
    """How FSDP2 lays the data-parallel ranks out: ``shard`` ranks split each parameter, and
    ``replicate`` groups of them hold the same shards (HSDP; 1 without ``plan.fsdp.hybrid``)."""

    shard: int
    replicate: int = 1


def fsdp_mesh(plan: ResolvedPlan, devices_per_node: int) -> FSDPMesh:
    """The data-parallel mesh of an FSDP2 plan. Hybrid sharding shards over the data-parallel
    ranks of one node (``devices_per_node / tp`` of them; a tensor-parallel group stays in a node)
    and replicates across nodes; otherwise every data-parallel rank holds one shard."""
    if not plan.fsdp.hybrid:
        # Context-parallel ranks hold the same parameters: FSDP2 shards over them too.
        return FSDPMesh(shard=plan.dp * plan.cp)
    per_node = max(devices_per_node // max(plan.tp * plan.pp, 1), 1)
    shard = min(plan.dp, per_node)
    return FSDPMesh(shard=shard, replicate=max(plan.dp // shard, 1))


@dataclass(frozen=True, kw_only=True)
class FSDPUnits:
    """Parameters of the model as FSDP2 wraps it: its blocks, and the root that holds the rest."""

    root: int
    """Parameters no block owns (embeddings, head, final norm): the root ``fully_shard`` unit."""
    root_trainable: int
    largest_block: int
    """Parameters of the largest block: what one all-gather brings in."""
    largest_block_trainable: int
    blocks: int
    """Parameters of all blocks together."""
    root_trainable_before_blocks: int | None = None
    """Of ``root_trainable``, the parameters whose gradients backward makes before it reaches the
    blocks (the root's layers after them in forward: head and final norm); None: all of them, as in
    a whole model, whose root holds the head. A pipeline stage's root may hold only layers before
    its blocks (the first stage's embedding): their gradients come after the blocks'."""


def fsdp_units(module: torch.nn.Module) -> FSDPUnits:
    """:class:`FSDPUnits` of ``module`` (works on ``meta``); a tied parameter counts once, in the
    first unit that reaches it (FSDP2 manages a shared parameter in one unit)."""
    seen: set[int] = set()
    largest, largest_trainable, blocks = 0, 0, 0
    for unit in checkpoint_units(module):
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        count = sum(p.numel() for p in params)
        blocks += count
        if count > largest:
            largest, largest_trainable = count, sum(p.numel() for p in params if p.requires_grad)
    rest = [p for p in {id(p): p for p in module.parameters()}.values() if id(p) not in seen]
    return FSDPUnits(root=sum(p.numel() for p in rest), root_trainable=sum(p.numel() for p in rest if p.requires_grad),
                     largest_block=largest, largest_block_trainable=largest_trainable, blocks=blocks)


@dataclass(frozen=True, kw_only=True)
class Part:
    """One named allocation of an FSDP2 rank and the kind it counts under in the breakdown."""

    name: str
    kind: str
    """A :class:`orch.plans.memory.states.PhaseBytes` field: params, grads, optimizer_states, activations or buffers."""
    bytes: int


@dataclass(frozen=True, kw_only=True)
class FSDPPhase:
    """What an FSDP2 rank holds between steps, or what one phase of a step adds, by name."""

    phase: str
    parts: tuple[Part, ...] = ()

    def as_phase_bytes(self) -> PhaseBytes:
        # One pass over the parts: the tuner turns millions of phases into bytes.
        kinds = dict.fromkeys(("params", "grads", "optimizer_states", "activations", "buffers"), 0)
        for part in self.parts:
            kinds[part.kind] += part.bytes
        return PhaseBytes(phase=self.phase, **kinds)

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)


@dataclass(frozen=True, kw_only=True)
class FSDPMemory:
    """One FSDP2 rank through a step, part by part."""

    mesh: FSDPMesh
    held: FSDPPhase
    phases: list[FSDPPhase]
    host: tuple[Part, ...] = ()
    """What CPU offload keeps in host memory for this rank."""
    states: ModelStateBytes = field(default_factory=lambda: ModelStateBytes(params=0, grads=0, optimizer_states=0))

    def device_phases(self) -> DevicePhases:
        return DevicePhases(held=self.held.as_phase_bytes(), phases=[p.as_phase_bytes() for p in self.phases])

    @property
    def binding(self) -> FSDPPhase:
        """The phase whose transients are largest (the same one :attr:`DevicePhases.binding` picks)."""
        return max(self.phases, key=lambda p: p.total)

    def at_peak(self) -> list[Part]:
        """Every part alive at the peak: what is held, then the binding phase's transients."""
        return [p for p in (*self.held.parts, *self.binding.parts) if p.bytes]

    json_key: ClassVar[str] = "fsdp"
    """Where `orch check --json` puts :meth:`as_json` (the key is there, null, for every plan)."""

    def as_json(self, phase: str) -> dict:
        """The rank's mesh and parts at the peak (in ``phase``) and on the host, for `orch check --json`."""
        return {"shard_group": self.mesh.shard, "replicas": self.mesh.replicate, "phase": phase,
                "at_peak": {p.name: p.bytes for p in self.at_peak()},
                "on_host": {p.name: p.bytes for p in self.host}}

    def report_lines(self, phase: str, fmt: Callable[[int], str]) -> list[str]:
        """The rank's parts at its peak, by name, and what offload keeps on the host (`orch check`)."""
        mesh = f"shards over {self.mesh.shard} rank(s)" + (f", {self.mesh.replicate} replicas (hybrid)"
                                                             if self.mesh.replicate > 1 else "")
        lines = ["", f"FSDP2 per device at the peak ({phase} phase), by part; {mesh}"]
        lines += [f"  {part.name:<44}{fmt(part.bytes)}" for part in self.at_peak()]
        if self.host:
            lines.append("  in host memory (CPUOffloadPolicy)")
            lines += [f"    {part.name:<42}{fmt(part.bytes)}" for part in self.host]
        return lines


def fsdp_memory(engine: EngineSettings, *, mesh: FSDPMesh, model: ModelStats, units: FSDPUnits,
                activations: ActivationBytes, precision: Precision, optimizer: OptimizerName, momentum: float,
                grad_accum_steps: int = 1) -> FSDPMemory:
    """The parts of one FSDP2 rank (see the module docstring for where each comes from).

    ``model`` and ``units`` are the counts one tensor-parallel rank holds.
    """
    n = max(mesh.shard, 1)
    b = precision.element_bytes
    psi, phi = model.param_count, model.trainable_count
    offloaded = engine.offload_param != Offload.none

    def part(x: int) -> int:
        return -(-x // n)

    sharded_params = _FP32 * part(psi)
    moments = _optimizer_moment_bytes(optimizer, momentum) * part(phi)
    sharded_grads = _FP32 * part(phi)
    device_params, device_moments, device_grads = (0, 0, 0) if offloaded else (sharded_params, moments, sharded_grads)
    states = ModelStateBytes(params=device_params, grads=device_grads, optimizer_states=device_moments,
                             host_params=sharded_params - device_params, host_grads=sharded_grads - device_grads,
                             host_optimizer_states=moments - device_moments)
    dtype = "fp32" if b == _FP32 else precision.base.value
    held = FSDPPhase(phase="held", parts=(
        Part(name="sharded parameters (fp32)", kind="params", bytes=device_params),
        Part(name="optimizer states (sharded)", kind="optimizer_states", bytes=device_moments),
    ))

    root = Part(name=f"root parameters, gathered ({dtype})", kind="buffers", bytes=b * units.root)
    block = b * units.largest_block
    buffer = Part(name=f"all-gather buffer, one block ({dtype})", kind="buffers", bytes=block if n > 1 else 0)
    if engine.reshard_after_forward:
        gathered = (Part(name=f"gathered block ({dtype})", kind="buffers", bytes=block), buffer)
    else:
        gathered = (Part(name=f"gathered blocks kept to backward ({dtype})", kind="buffers",
                         bytes=b * units.blocks), buffer)
    accumulating = grad_accum_steps > 1
    earlier = Part(name="sharded gradients (fp32)", kind="grads", bytes=device_grads if accumulating else 0)
    forward = FSDPPhase(phase="forward", parts=(
        Part(name="activations", kind="activations", bytes=activations.forward_peak), root, *gathered, earlier))
    # Backward starts in the loss and the head, which the root owns: the activations are at their
    # backward peak, and besides the root the last block's parameters are in flight (its flat
    # all-gather output from forward, freed at the next copy-out, or the root's pre-backward
    # prefetch of it); without resharding every block is still gathered.
    backward_gathered = gathered if engine.reshard_after_forward else gathered[:1]
    root_grads = Part(name=f"root gradients, unsharded ({dtype})", kind="grads", bytes=b * units.root_trainable)
    # What the blocks' backward meets of them: the gradients of the root's layers after the blocks.
    early = units.root_trainable if units.root_trainable_before_blocks is None else units.root_trainable_before_blocks
    early_root_grads = Part(name=f"root gradients, unsharded ({dtype})", kind="grads", bytes=b * early)
    in_head = gathered[1:] if engine.reshard_after_forward else gathered[:1]
    head_phases = [FSDPPhase(phase="head backward", parts=(
        Part(name="activations", kind="activations", bytes=activations.backward_peak), root, *in_head,
        early_root_grads, earlier))]
    if engine.reshard_after_forward and activations.loss_backward_peak:
        # The root reshards after forward too (orch passes fully_shard the plan's setting, where
        # torch's default would keep the root gathered), and gathers again in the hook on the
        # gradient of its output: the loss's backward, where the activations peak with the
        # logits' gradients, meets no root parameters; the head's backward meets them and makes
        # the root's gradients.
        head_phases = [
            FSDPPhase(phase="loss backward", parts=(
                Part(name="activations", kind="activations", bytes=activations.loss_backward_peak), earlier)),
            FSDPPhase(phase="head backward", parts=(
                Part(name="activations", kind="activations", bytes=activations.head_backward_peak), root, *in_head,
                early_root_grads, earlier))]
    # Inside the blocks the activations peak in the first block backward reaches (the last
    # layer): that block and the prefetched previous one are gathered and its gradients are being
    # made. From the next block on, the previous block's reduce-scatter input and output stay
    # alive until the next reduce-scatter (``reduce_scatter_states``, kept for overlap): they meet
    # the activations' peak over the other blocks.
    block_grads = Part(name=f"one block's gradients, unsharded ({dtype})", kind="grads",
                       bytes=b * units.largest_block_trainable)
    reduce_input = Part(name="reduce-scatter input, one block (fp32)", kind="buffers",
                        bytes=_FP32 * units.largest_block_trainable)
    blocks = activations.blocks_backward_peak or activations.backward_peak
    backward = FSDPPhase(phase="first block backward", parts=(
        Part(name="activations", kind="activations", bytes=blocks), root, *backward_gathered, early_root_grads,
        block_grads, earlier))
    later = activations.later_blocks_backward_peak if activations.blocks_backward_peak else blocks
    later_blocks = FSDPPhase(phase="later blocks backward", parts=(
        Part(name="activations", kind="activations", bytes=later), root, *backward_gathered, early_root_grads,
        block_grads, reduce_input,
        Part(name="sharded gradients (fp32)", kind="grads",
             bytes=device_grads if accumulating else part(_FP32 * units.largest_block_trainable))))
    # Leaving the blocks: the first block's gradients are copied into the fp32 reduce-scatter
    # input while every other block's are sharded already; the activations are down to what the
    # embedding's backward needs. The activation peak and the gradients' growth meet at these two
    # ends (both move along a line over the blocks).
    reduce_block = FSDPPhase(phase="last block reduce-scatter", parts=(
        Part(name="activations", kind="activations", bytes=activations.blocks_backward_end or blocks),
        root, early_root_grads, block_grads, reduce_input,
        Part(name="sharded gradients (fp32)", kind="grads", bytes=device_grads)))
    # The root reduce-scatters last, once autograd is done: its gradients and their fp32 copy.
    reduction = FSDPPhase(phase="reduction", parts=(
        root, root_grads,
        Part(name="reduce-scatter input, root (fp32)", kind="buffers", bytes=_FP32 * units.root_trainable),
        Part(name="sharded gradients (fp32)", kind="grads", bytes=device_grads)))
    phases = [forward, *head_phases, backward, later_blocks, reduce_block, reduction]
    if not offloaded:
        # torch's fused Adam steps every tensor in place. Its multi-tensor (foreach) kernel, taken
        # under fp16's loss scaler, makes one temporary of every moment at once
        # (torch._foreach_sqrt of exp_avg_sq).
        temporaries = 0
        if engine.torch_adam and not engine.fused_adam:
            temporaries = _FP32 * part(phi)
        phases.append(FSDPPhase(phase="optimizer step", parts=(
            Part(name="sharded gradients (fp32)", kind="grads", bytes=device_grads),
            Part(name="optimizer step temporaries", kind="buffers", bytes=temporaries))))
    host = ()
    if offloaded:
        host = (Part(name="sharded parameters (fp32), on host", kind="params", bytes=sharded_params),
                Part(name="sharded gradients (fp32), on host", kind="grads", bytes=sharded_grads),
                Part(name="optimizer states, on host", kind="optimizer_states", bytes=moments))
    return FSDPMemory(mesh=mesh, held=held, phases=phases, host=host, states=states)
