"""A small GPT-style decoder, the built-in model.

Contract every model trained by the orchestrator follows (a user's own ``torch.nn.Module``
selected through Hydra's ``_target_`` too): ``forward(input_ids: LongTensor[B, T]) ->
logits[B, T, vocab]``. A model that can recompute activations in backward exposes
``gradient_checkpointing_enable()`` (the name Hugging Face models use).

Tensor parallelism (``plan.tp > 1``) is applied *after* the model is built, by DeepSpeed's AutoTP
or, under FSDP2, DTensor's column- and row-wise styles: :data:`TP_LAYER_SPECS` names the layers
they shard (FSDP2 also splits the output head over the vocabulary, a tied one with its embedding).
The model itself is never told which shard it holds: its attention reads the number of local
heads off the width of ``qkv``'s output, so the same code runs whole (on ``meta`` in the planner,
at tp=1) and sharded.

Pipeline parallelism (``plan.pp > 1``) needs the model as a flat sequence of layers, each stage
building only its own: :meth:`GPT.pipeline_layers` describes them as
:class:`orch.plans.parallel.stage_layers.StageLayer` objects, which the training engine turns into its own.
Every layer draws its initial weights from a seed of its own (the run's seed and the layer's
index), so the model built whole and the model built stage by stage start from the same weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from orch.plans.engines import whole_parameters
from orch.plans.parallel.stage_layers import StageLayer

# How AutoTP shards the built-in GPT, in the schema of DeepSpeed's
# ``tensor_parallel.partition_config.layer_specs`` (deepspeed/module_inject/autotp_config.py):
# regexes matched against full parameter names. Megatron's layout: the first linear of each
# sublayer is column-parallel (its output split by heads or hidden units, no communication in
# forward) and the second row-parallel (its input split, one all-reduce in forward). ``qkv``'s
# rows are ordered head by head, each head's q, k and v together (Megatron-LM's layout of its fused
# QKV), so a plain column split hands every rank whole heads of all three: the same spec serves
# DeepSpeed's AutoTP and DTensor's column-wise style. Embeddings, the (tied) output head and the
# layer norms match no spec (the FSDP2 engine adds the head, plan.loss_parallel).
TP_LAYER_SPECS: list[dict] = [
    {"patterns": [r".*\.attn\.qkv\.weight$", r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.attn\.proj\.weight$", r".*\.mlp\.proj\.weight$"], "partition_type": "row"},
]


def layer_seed(base: int, index: int) -> int:
    """The seed layer ``index`` initializes its weights from (a pure function of the run's seed)."""
    return (base * 1_000_003 + index) % 2**63


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _initialize(module: nn.Module, seed: int | None) -> nn.Module:
    """Initialize ``module``'s weights from ``seed`` without disturbing the global RNG.

    Built under ``deepspeed.zero.Init`` (ZeRO-3), the children's parameters are already
    partitioned here: they are gathered for the initialization (DeepSpeed's documented way to
    modify partitioned parameters), so every rank's shard is cut from the same seeded values.
    """
    with _gathered(module):
        if seed is None:
            module.apply(_init_weights)
            return module
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module.apply(_init_weights)
    return module


def _gathered(module: nn.Module):
    """A context in which the parameters of ``module`` are whole and writable, whichever engine
    partitioned them while it was built (ZeRO-3's ``zero.Init``)."""
    return whole_parameters(list(module.parameters())) or contextlib.nullcontext()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, *, dropout: float = 0.0, fused: bool = True):
        super().__init__()
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # qkv's output is [heads, (q, k, v), head_dim] per token. Under tensor parallelism qkv is
        # column-sharded, so it holds this rank's heads only, and proj (row-sharded) takes exactly
        # their width and all-reduces to the full d_model.
        qkv = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim))
        heads = qkv.shape[2]
        width = heads * self.head_dim
        q, k, v = (y.transpose(1, 2) for y in qkv.unbind(3))
        dropout = self.dropout if self.training else 0.0
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            y = _explicit_attention(q, k, v, dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """Causal attention with its scores written out: one batched matmul that scales them and adds
    the causal mask, softmax, dropout, and the matmul with the values (Megatron-LM's kernels
    before fused attention, its mask and scale applied in the matmul here instead of the softmax)."""
    b, h, t, d = q.shape
    mask = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1).unsqueeze(0)
    scores = torch.baddbmm(mask, q.reshape(b * h, t, d), k.reshape(b * h, t, d).transpose(1, 2),
                           alpha=d ** -0.5)
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout, training=dropout > 0)
    return torch.bmm(probs, v.reshape(b * h, t, d)).reshape(b, h, t, d)


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, init_seed: int | None = None, *, dropout: float = 0.0,
                 fused_attention: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout=dropout, fused=fused_attention)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.dropout = dropout
        _initialize(self, init_seed)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=self.training) if self.dropout else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln_1(x)))
        return x + self._drop(self.mlp(self.ln_2(x)))


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids [B, T] -> hidden [B, T, d_model]."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, init_seed: int | None = None):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        _initialize(self, init_seed)

    context_positions: torch.Tensor | None = None
    """Set by an engine that splits each sample's sequence over context-parallel ranks and runs
    this layer as a pipeline stage's (which is called with the token ids alone): the positions of
    the rank's tokens in the whole sequence ([1, tokens])."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ([1 or batch, tokens]) number tokens that are a part of a longer sequence
        (context parallelism); by default :attr:`context_positions`, or positions 0, 1, ..."""
        pos = position_ids if position_ids is not None else self.context_positions
        if pos is None:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(pos)


class LMHead(nn.Module):
    """The output projection when it is not tied to the token embedding."""

    def __init__(self, d_model: int, vocab_size: int, init_seed: int | None = None):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        _initialize(self, init_seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class TiedHead(nn.Module):
    """The output head that reuses the token embedding's weight, handed to it at each call.

    A module of its own, without a parameter (the state dict holds the weight once, as the
    embedding's), so tensor parallelism can lay out its input for the embedding's weight split
    over the vocabulary (``plan.loss_parallel``); ``reuses_input_embedding`` tells the
    orchestrator so (:func:`orch.plans.parallel.vocab_parallel.output_head`).
    """

    reuses_input_embedding = True

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


def tied_logits(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head that reuses the token embedding's weight (the last pipeline stage's copy).
    With the embedding split over the vocabulary across tensor-parallel ranks (a DTensor weight,
    ``plan.loss_parallel``), every rank takes the whole hidden state and computes the logits of its
    part of the vocabulary, left split for the loss."""
    weight = embedding.wte.weight
    if hasattr(weight, "device_mesh") and not hasattr(x, "device_mesh"):
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
    return F.linear(x, weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy in fp32, as the trainer computes it with or without a pipeline."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and (optionally) tied embeddings.

    Layer ``i`` of :meth:`pipeline_layers` (the embedding is 0, block ``k`` is ``k + 1``, an untied
    head is last) is initialized from ``layer_seed(torch.initial_seed(), i)``.
    """

    tp_layer_specs = TP_LAYER_SPECS
    """How AutoTP shards this model (read by the orchestrator; never applied to another model)."""

    def __init__(self, *, n_layer: int = 2, d_model: int = 128, n_head: int = 4, seq_len: int = 128,
                 vocab_size: int = 256, tie_embeddings: bool = True, dropout: float = 0.0,
                 fused_attention: bool = True, tp: int = 1):
        """``tp`` is the tensor-parallel degree the model will be sharded over (the config ties it
        to ``plan.tp``); the model only checks that its heads split evenly, AutoTP does the rest."""
        super().__init__()
        _check_arguments(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                         tp=tp, dropout=dropout)
        base = torch.initial_seed()
        block = {"dropout": dropout, "fused_attention": fused_attention}
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.embed = Embedding(vocab_size, seq_len, d_model, init_seed=layer_seed(base, 0))
        self.blocks = nn.ModuleList(Block(d_model, n_head, init_seed=layer_seed(base, 1 + i), **block)
                                    for i in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.tie_embeddings = tie_embeddings
        self.lm_head = TiedHead() if tie_embeddings else LMHead(d_model, vocab_size,
                                                                init_seed=layer_seed(base, n_layer + 2))
        self.activation_checkpointing = False
        self.checkpoint_kwargs: dict = {}
        self.checkpoint_every_n_layers = 1

    @classmethod
    def pipeline_layers(cls, *, n_layer: int = 2, d_model: int = 128, n_head: int = 4, seq_len: int = 128,
                        vocab_size: int = 256, tie_embeddings: bool = True, dropout: float = 0.0,
                        fused_attention: bool = True, tp: int = 1) -> list[StageLayer]:
        """The model as pipeline stage layers, built lazily by the stage that owns each.

        Embedding, the blocks, the final norm and the head: the same modules, weights and
        arithmetic as :meth:`forward`. A tied head shares the embedding (``tie="embed"``), so the
        first and last stages each hold a copy whose gradients the engine sums across the two.
        """
        _check_arguments(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                         tp=tp, dropout=dropout)
        base = torch.initial_seed()
        embed = (Embedding, vocab_size, seq_len, d_model)
        tied = {"tie": "embed", "tied_weight_attr": "wte.weight", "init_seed": layer_seed(base, 0)}
        layers = [StageLayer.of(*embed, names={"": "embed."}, **tied)]
        layers += [StageLayer.of(Block, d_model, n_head, init_seed=layer_seed(base, 1 + i), dropout=dropout,
                                 fused_attention=fused_attention, names={"": f"blocks.{i}."}) for i in range(n_layer)]
        layers.append(StageLayer.of(nn.LayerNorm, d_model, names={"": "ln_f."}))
        if tie_embeddings:
            layers.append(StageLayer.of(*embed, forward_fn=tied_logits, names={"": "embed."}, **tied))
        else:
            layers.append(StageLayer.of(LMHead, d_model, vocab_size, init_seed=layer_seed(base, n_layer + 2),
                                        names={"": "lm_head."}))
        return layers

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1) -> None:
        """Recompute the activations of blocks 0, n, 2n, ... (n: ``every_n_layers``; 1: every block)
        in backward instead of saving them; ``gradient_checkpointing_kwargs`` go to
        ``torch.utils.checkpoint.checkpoint`` (Hugging Face's names and meanings: a selective
        policy's ``context_fn``)."""
        self.activation_checkpointing = True
        self.checkpoint_kwargs = dict(gradient_checkpointing_kwargs or {})
        self.checkpoint_every_n_layers = every_n_layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.seq_len:
            # Positions past the learned table would index out of range (silently so on meta).
            raise ValueError(f"input of {input_ids.shape[1]} tokens is longer than model.seq_len({self.seq_len}): "
                             "the model learns one position embedding per token; set data.seq_len to at most "
                             "model.seq_len")
        x = self.embed(input_ids, position_ids)
        for index, block in enumerate(self.blocks):
            recomputed = self.activation_checkpointing and index % self.checkpoint_every_n_layers == 0
            if recomputed and torch.is_grad_enabled():
                x = checkpoint(block, x, **{"use_reentrant": False, **self.checkpoint_kwargs})
            else:
                x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x, self.embed.wte.weight) if self.tie_embeddings else self.lm_head(x)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (Hugging Face's name for it)."""
        return self.embed.wte

    def get_output_embeddings(self) -> nn.Module:
        """The output head (Hugging Face's name): its linear layer, or the :class:`TiedHead` that
        computes the logits with the token embedding's weight."""
        return self.lm_head if self.tie_embeddings else self.lm_head.proj


def _check_arguments(*, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int, tp: int,
                     dropout: float = 0.0) -> None:
    """Refuse arguments no GPT can be built from, naming the config key (the planner builds the
    model on meta before anything starts and reports this message as the config's problem)."""
    sizes = {"model.n_layer": n_layer, "model.d_model": d_model, "model.n_head": n_head, "model.seq_len": seq_len,
             "model.vocab_size": vocab_size, "plan.tp": tp}
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"{key}({value}) must be at least 1")
    if not 0 <= dropout < 1:
        raise ValueError(f"model.dropout({dropout}) must be in [0, 1): the probability of zeroing an element")
    if d_model % n_head:
        raise ValueError(f"model.d_model({d_model}) must be divisible by model.n_head({n_head})")
    if tp >= 1 and n_head % tp:
        # Each tensor-parallel rank computes whole attention heads; since n_head divides d_model,
        # this also makes d_model and the MLP width (4 * d_model) divisible by tp.
        raise ValueError(f"model.n_head({n_head}) must be divisible by plan.tp({tp}): each tensor-parallel "
                         f"rank holds n_head / tp whole heads (n_head % tp = {n_head % tp}); "
                         "choose plan.tp among the divisors of model.n_head")
