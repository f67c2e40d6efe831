"""Context parallelism in the fsdp2 engine (``plan.cp > 1``): each rank runs the model on its part of
every sample's sequence (:mod:`orch.plans.parallel.context_parallel` says which part and how
attention spans the parts).

The ranks of one context-parallel group read the same batch (they share ``dp_rank``). Each keeps
its tokens of every tensor that runs along the sequence and gives the model their positions in
the whole sequence; while a step runs (forward, and backward, which re-runs a recomputed
block's forward), ``torch.nn.functional.scaled_dot_product_attention`` is
:func:`orch.plans.parallel.context_parallel.split_attention` over the group. Each rank's loss is
the mean over its tokens, equal in number on every rank, so the mean of the ranks' losses, and
of their gradients (FSDP2 averages them over the data- and context-parallel ranks together), is
the whole sequence's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


class ContextSplit:
    """This rank's part of each sequence and the attention over the parts, for one context-parallel group."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.cp = mesh.size()
        self.cp_rank = mesh.get_local_rank()
        self._positions: dict[tuple[int, Any], torch.Tensor] = {}

    def local(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``batch`` with every tensor that runs along the sequence cut to this rank's tokens, and
        their positions in the whole sequence ([1, tokens]). The sequence is the first tensor's
        second dimension (the inputs' ``[batch, sequence]``); tensors of other shapes (a label per
        sample) are kept whole."""
        from orch.plans.parallel.context_parallel import SEQUENCE_DIM, cut_sequence

        first = _first_tensor(batch)
        if first is None or first.dim() < 2:
            raise RuntimeError("plan.cp > 1 splits each sample's sequence, but the batch's inputs have no sequence "
                               "dimension ([batch, sequence, ...]); set plan.cp=1")
        seq_len = first.shape[SEQUENCE_DIM]
        return cut_sequence(batch, seq_len, self.cp_rank, self.cp), self.positions(seq_len, first.device)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of this rank's tokens of a ``seq_len`` sequence ([1, tokens]): one tensor per
        length and device, made once (pipeline layers recognise it by identity)."""
        import torch

        from orch.plans.parallel.context_parallel import local_positions

        key = (seq_len, device)
        if key not in self._positions:
            self._positions[key] = torch.tensor([local_positions(seq_len, self.cp_rank, self.cp)], device=device)
        return self._positions[key]

    def call(self, model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
        """The model's outputs on this rank's part of ``batch``, and that part (for the objective)."""
        from orch.plans.model.workload import call_model
        from orch.plans.parallel.context_parallel import call_kwargs

        part, positions = self.local(batch)
        return call_model(model, part, **call_kwargs(_unwrapped_forward_owner(model), positions, part)), part

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """``scaled_dot_product_attention`` spread over the group while the block runs; torch's
        function is put back after, whatever happened."""
        import torch.nn.functional as F

        from orch.plans.parallel.context_parallel import split_attention

        original = F.scaled_dot_product_attention

        def spread(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            if query.device.type == "meta":
                # torch's pipeline stages infer their outputs' shapes by a forward on meta: the
                # split attention's output has the queries' shape, and nothing is gathered there.
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, enable_gqa=enable_gqa)
            return split_attention(query, key, value, gather=self._gather, cp_rank=self.cp_rank, cp=self.cp,
                                   sdpa=original, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                   scale=scale, enable_gqa=enable_gqa)

        F.scaled_dot_product_attention = spread
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along attention's sequence dimension, in rank order.
        Each rank's gathered copy feeds only its own queries, so the gradients differ by rank: they
        come back as partial sums (``Partial``), reduce-scattered to each rank's part."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        from orch.plans.parallel.context_parallel import ATTENTION_SEQUENCE_DIM

        split = DTensor.from_local(tensor, self.mesh, [Shard(ATTENTION_SEQUENCE_DIM)], run_check=False)
        return split.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """A per-token output of this rank's part ([batch, tokens, ...]) gathered from every rank
        into the whole sequence's, in sequence order (the outputs an export is checked against)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from orch.plans.parallel.context_parallel import SEQUENCE_DIM, in_sequence_order

        gathered = DTensor.from_local(part.contiguous(), self.mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        return in_sequence_order(gathered.redistribute(self.mesh, [Replicate()]).to_local(), SEQUENCE_DIM, self.cp)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the group (a loss or metric over each rank's tokens)."""
        import torch
        import torch.distributed as dist

        total = torch.tensor(value, dtype=torch.float64, device=_mesh_device(self.mesh))
        dist.all_reduce(total, group=self.mesh.get_group())
        return float(total) / self.cp


def _first_tensor(batch: Any) -> torch.Tensor | None:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return next((item for item in batch if isinstance(item, torch.Tensor)), None)
    return None


def _unwrapped_forward_owner(model: Any) -> Any:
    """The module whose ``forward`` signature names the model's arguments (``fully_shard`` keeps the
    module and its forward, and ``plan.compile`` compiles in place; a model compiled before it came
    here hides its module under ``_orig_mod``)."""
    return getattr(model, "_orig_mod", model)


def _mesh_device(mesh: DeviceMesh) -> str:
    import torch

    return f"cuda:{torch.cuda.current_device()}" if mesh.device_type == "cuda" else "cpu"
