"""Context parallelism (``plan.cp``): where each rank's part of a sequence lies, and attention over it.

Each sample's sequence is cut into ``2 * cp`` equal chunks and rank ``r`` of the context-parallel
group keeps chunks ``r`` and ``2 * cp - 1 - r`` (the head-tail balance torch's
``context_parallel`` uses): under a causal mask a later chunk attends to more keys, and pairing an
early chunk with a late one gives every rank the same attention work. Everything but attention
runs on the rank's tokens alone; attention gathers every rank's keys and values (the all-gather
form Llama 3's long-context training used; with grouped-query attention they are a fraction of
the queries' bytes) and each local chunk attends to the keys up to its own end, causal aligned
to the bottom right. The gather's backward reduce-scatters the keys' and values' gradients.

torch's own ``context_parallel`` (ring attention) dispatches only the CUDA attention kernels,
so CPU workers could not run it; this form runs wherever ``scaled_dot_product_attention`` does,
and the planner runs the same function on ``meta`` (:func:`split_attention` with a gather that
repeats the local keys), so what it measures is what the engine keeps.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

SEQUENCE_DIM = 1
"""The sequence dimension of a batch's tensors and of the hidden states ([batch, sequence, ...])."""
ATTENTION_SEQUENCE_DIM = 2
"""The sequence dimension of attention's queries, keys and values ([batch, heads, sequence, head_dim])."""


def chunk_order(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) rank ``cp_rank`` keeps, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def gathered_chunks(cp: int) -> list[int]:
    """The chunk at each position of a gather of every rank's part, in rank order."""
    return [chunk for rank in range(cp) for chunk in chunk_order(rank, cp)]


def local_positions(seq_len: int, cp_rank: int, cp: int) -> list[int]:
    """The positions in the whole sequence of the tokens rank ``cp_rank`` keeps, in its order."""
    size = seq_len // (2 * cp)
    return [p for chunk in chunk_order(cp_rank, cp) for p in range(chunk * size, (chunk + 1) * size)]


def cut_sequence(batch: Any, seq_len: int, cp_rank: int, cp: int) -> Any:
    """``batch`` with every tensor that runs along the sequence (``[batch, seq_len, ...]``) cut to
    the tokens rank ``cp_rank`` keeps (:func:`local_positions`), in its order; tensors of other
    shapes (a label per sample) are kept whole. Used by the engine and, on meta, by the planner."""
    import torch

    from orch.plans.model.workload import map_tensors

    positions = local_positions(seq_len, cp_rank, cp)

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2 or tensor.shape[SEQUENCE_DIM] != seq_len:
            return tensor
        return tensor.index_select(SEQUENCE_DIM, torch.tensor(positions, device=tensor.device))

    return map_tensors(batch, cut)


def in_sequence_order(gathered: Any, dim: int, cp: int) -> Any:
    """A gather of every rank's two chunks along ``dim`` (in rank order, :func:`gathered_chunks`)
    put back in sequence order."""
    import torch

    size = gathered.shape[dim] // (2 * cp)
    placed = gathered_chunks(cp)
    return torch.cat([gathered.narrow(dim, placed.index(chunk) * size, size) for chunk in range(2 * cp)], dim)


def sequence_problem(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> str | None:
    """Why a sequence of ``seq_len`` tokens cannot be split over ``cp`` ranks, or None."""
    if seq_len % (2 * cp):
        return (f"the sequence of {seq_len} tokens does not split into 2 * cp = {2 * cp} equal chunks "
                f"({seq_len} % {2 * cp} = {seq_len % (2 * cp)})")
    if sequence_parallel and (seq_len // cp) % tp:
        return (f"each rank's {seq_len // cp} tokens (sequence {seq_len} / cp {cp}) do not split over the "
                f"tp({tp}) ranks of sequence parallelism")
    return None


def forward_problem(model: Any) -> str | None:
    """Why ``model`` cannot run on a part of the sequence, or None: it must take the tokens'
    positions in the whole sequence (``position_ids``, as Hugging Face models do)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return f"the signature of {type(model).__name__}.forward cannot be read"
    if "position_ids" not in parameters:
        return (f"{type(model).__name__}.forward takes no position_ids: on a part of the sequence it would number "
                "its tokens from 0")
    return None


def call_kwargs(model: Any, positions: Any, batch: Any = None) -> dict[str, Any]:
    """What a model running on a part of the sequence is given besides its inputs: the positions of
    its tokens, and, where the model takes one, an all-ones attention mask; neither where the batch
    (a dict of keyword arguments) gives its own, already cut to the rank's part. A Hugging Face
    decoder reads positions that jump (the head-tail chunks) as packed sequences and masks them
    apart; a mask that names every token as real keeps its attention causal over the one
    sequence, which :func:`split_attention` then spreads over the ranks."""
    import torch

    given = set(batch) if isinstance(batch, dict) else set()
    kwargs: dict[str, Any] = {"position_ids": positions}
    if "attention_mask" in inspect.signature(model.forward).parameters:
        kwargs["attention_mask"] = torch.ones_like(positions, dtype=torch.long)
    return {key: value for key, value in kwargs.items() if key not in given}


def split_attention(query, key, value, *, gather: Callable[[Any], Any], cp_rank: int, cp: int,
                    sdpa: Callable[..., Any], attn_mask: Any = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                    grouped_keys: bool | None = None):
    """Causal ``scaled_dot_product_attention`` of this rank's queries over every rank's keys and values.

    ``query``, ``key`` and ``value`` hold this rank's two chunks (:func:`chunk_order`) along dim 2;
    ``gather`` returns a tensor's every-rank concatenation in rank order (an all-gather whose
    backward reduce-scatters, or a stand-in on meta); ``sdpa`` is torch's own function. Each local
    chunk attends to the whole sequence's keys up to its end, causal aligned to the bottom right;
    the first chunk of the sequence (its keys as long as its queries) needs no mask. A CUDA kernel
    that takes a mask does not take grouped-query keys, so there they are expanded to the queries'
    heads (``grouped_keys``: whether the kernel takes them; by default, off CUDA).
    """
    import torch

    if attn_mask is not None or not is_causal:
        raise RuntimeError("plan.cp > 1 splits causal attention without a mask; the model called "
                           f"scaled_dot_product_attention with is_causal={is_causal} and "
                           f"{'a' if attn_mask is not None else 'no'} mask; set plan.cp=1")
    dim = ATTENTION_SEQUENCE_DIM
    size = query.shape[dim] // 2
    # The gathered chunks back in sequence order, so that a chunk's keys are one prefix.
    keys = in_sequence_order(gather(key.contiguous()), dim, cp)
    values = in_sequence_order(gather(value.contiguous()), dim, cp)
    if grouped_keys is None:
        grouped_keys = query.device.type != "cuda"
    if enable_gqa and not grouped_keys and keys.shape[1] != query.shape[1]:
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        enable_gqa = False
    outputs = []
    for i, chunk in enumerate(chunk_order(cp_rank, cp)):
        end = (chunk + 1) * size
        causal = {"is_causal": True} if chunk == 0 else {"attn_mask": lower_right_mask(size, end, query.device)}
        outputs.append(sdpa(query.narrow(dim, i * size, size), keys.narrow(dim, 0, end), values.narrow(dim, 0, end),
                            dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa, **causal))
    return torch.cat(outputs, dim)


class LocalSequenceInputs:
    """A workload's inputs as one of ``cp`` context-parallel ranks runs the model: every tensor of
    the example batch that runs along the sequence cut to the rank's tokens (the planner measures
    a rank's activations and work from it)."""

    def __init__(self, inputs: Any, cp: int) -> None:
        self.whole = inputs
        self.cp = cp
        self.objective = inputs.objective
        tokens = inputs.tokens_per_sample
        self.tokens_per_sample = tokens // cp if tokens else tokens

    def example_batch(self, batch_size: int) -> Any:
        return cut_sequence(self.whole.example_batch(batch_size), self.whole.tokens_per_sample, 0, self.cp)


def lower_right_mask(queries: int, keys: int, device: Any):
    """The causal mask of the last ``queries`` positions of ``keys`` (True: attends): query ``i``
    sees keys up to ``keys - queries + i``."""
    import torch

    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=keys - queries)
