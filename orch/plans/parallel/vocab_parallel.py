"""The output head split over its classes across the tensor-parallel ranks (``plan.loss_parallel``).

Megatron-LM's vocabulary-parallel head, as torchtitan runs it with DTensor: the head's weight is
split by rows (column-parallel), so each tensor-parallel rank computes the logits of 1/tp of the
vocabulary, and the cross-entropy is computed from those split logits (torch's
``loss_parallel``: a max, a sum of exponentials and the target's logit are all-reduced per token,
[tokens] each) instead of gathering [tokens, vocabulary] on every rank. Without it the head, its
logits and the loss run whole on every tensor-parallel rank: at a 128K vocabulary that is the
work of several blocks, repeated tp times.

The head is the one a Hugging Face model names (``get_output_embeddings()``, any model may offer
it), when the objective declares that its loss is a cross-entropy over the outputs' last dimension
(``loss_parallel = True``), which ``loss_parallel`` computes from the split logits, and the head is
either a linear layer of its own, or a module that computes the logits with the input embedding's
weight handed to it at each call and says so (``reuses_input_embedding = True``: the built-in GPT's
tied head), or a linear layer whose weight *is* the embedding's (a Hugging Face model's tied
``lm_head``, ``tie_word_embeddings``). A tied head splits its embedding with it: the embedding's
rows (the vocabulary) are split over the same ranks, each rank looks up the tokens of its rows and
the lookups are summed (Megatron-LM's vocabulary-parallel embedding), and the head computes its
logits from the same shard. Pure: the planner and the engine decide with the same functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from orch.plans.resolve import ResolvedPlan


@dataclass(frozen=True)
class OutputHead:
    """A model's output head that tensor parallelism can split along its classes."""

    name: str
    """Its module name in the model (``lm_head``)."""
    classes: int
    """Its output features: the vocabulary of a language model's head."""
    embedding: str | None = None
    """The input embedding whose weight it computes the logits with (a tied head; None: a linear
    layer of its own). Split with the head."""

    @property
    def weight_owner(self) -> str:
        """The module holding the head's weight: its own linear layer, or the tied embedding."""
        return self.embedding or self.name

    @property
    def layer_spec(self) -> dict:
        """The head's weight as a column-parallel layer (its rows, the vocabulary, split) in the schema
        of the model's tensor-parallel specs (DeepSpeed AutoTP's ``layer_specs``), which the planner
        shards its probe by: the tied embedding's rows are split the same way."""
        return {"patterns": [rf"^{re.escape(self.weight_owner)}\.weight$"], "partition_type": "column"}


def output_head(model: torch.nn.Module, objective: Any) -> OutputHead | None:
    """The head of ``model`` that ``plan.loss_parallel`` splits, or None: the model names no
    linear output head (nor a tied head that says so), the head shares its weight with an input
    embedding that is not an ``nn.Embedding``, or ``objective`` does not declare a loss
    ``loss_parallel`` computes (``objective.loss_parallel``)."""
    import torch

    if not getattr(objective, "loss_parallel", False):
        return None
    head = _called(model, "get_output_embeddings")
    embedding = _called(model, "get_input_embeddings")
    names = {id(module): name for name, module in model.named_modules() if name}
    if getattr(head, "reuses_input_embedding", False) is True and isinstance(embedding, torch.nn.Embedding):
        if id(head) not in names or id(embedding) not in names:
            return None
        return OutputHead(name=names[id(head)], classes=embedding.num_embeddings, embedding=names[id(embedding)])
    if not isinstance(head, torch.nn.Linear) or head.weight.dim() != 2 or id(head) not in names:
        return None
    if getattr(embedding, "weight", None) is head.weight:
        # Tied: the embedding's rows are the head's, split together.
        if not isinstance(embedding, torch.nn.Embedding) or id(embedding) not in names:
            return None
        return OutputHead(name=names[id(head)], classes=head.out_features, embedding=names[id(embedding)])
    return OutputHead(name=names[id(head)], classes=head.out_features)


def splits_head(plan: ResolvedPlan, head: OutputHead | None) -> bool:
    """Whether ``plan`` splits ``head`` over its tensor-parallel ranks: ``plan.loss_parallel`` under
    an engine that does (``EngineSpec.loss_parallel``), tp > 1, and a vocabulary the tp ranks divide
    evenly (:func:`kept_whole`); with pipeline stages, on the last one (a tied head's embedding on
    the first as well). Elsewhere the head stays whole on every rank."""
    return head is not None and plan.tp > 1 and kept_whole(plan, head) is None


def kept_whole(plan: ResolvedPlan, head: OutputHead) -> str | None:
    """Why ``plan`` leaves ``head`` whole on each of its tensor-parallel ranks, in a few words, or
    None when it splits it."""
    from orch.plans.engines import engine_spec

    if not engine_spec(plan.engine).loss_parallel:
        return f"the {plan.engine} engine keeps it whole"
    if not plan.loss_parallel:
        return "plan.loss_parallel=false"
    if head.classes % plan.tp:
        return f"its {head.classes:,} classes do not split {plan.tp} ways"
    return None


def describe_head(plan: ResolvedPlan, head: OutputHead | None) -> str:
    """The head's layout under ``plan`` in one line (`orch check`), or "" without tensor
    parallelism or such a head."""
    if head is None or plan.tp <= 1:
        return ""
    why = kept_whole(plan, head)
    if why is None:
        tied = f" with its tied embedding {head.embedding}" if head.embedding else ""
        return (f"{head.name} split over the vocabulary{tied} ({head.classes:,} / tp={plan.tp} per rank), the loss "
                "computed from the split logits (plan.loss_parallel)")
    return f"{head.name} ({head.classes:,} classes) whole on every tensor-parallel rank: {why}"


def _called(model: torch.nn.Module, method: str) -> Any:
    """``model.<method>()``, or None where the model has no such method or it declines (a
    Hugging Face base class raises NotImplementedError where a model did not implement it)."""
    found = getattr(model, method, None)
    if not callable(found):
        return None
    try:
        return found()
    except (NotImplementedError, AttributeError):
        return None
