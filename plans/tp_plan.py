"""DeepSpeed AutoTP layer specs from a model's own tensor-parallel plan.

Hugging Face models declare how they shard (``model._tp_plan``, built from the config's
``base_model_tp_plan``): module-name patterns with ``*`` for a layer index, each mapped to a
style. The column- and row-parallel linear layers become AutoTP ``layer_specs`` (regexes of
parameter names, as ``tensor_parallel.partition_config`` takes them). Embeddings and the
output head stay replicated, as they do for the built-in GPT: their styles
(``embedding_rowwise``, ``colwise_gather_output``) have no AutoTP counterpart here.
"""

from __future__ import annotations

import re

import torch

_STYLES = {"colwise": "column", "rowwise": "row"}


def _pattern(module_pattern: str) -> str:
    body = r"\d+".join(re.escape(part) for part in module_pattern.split("*"))
    return rf"(^|.*\.){body}\.weight$"


def specs_from_tp_plan(module: torch.nn.Module) -> list[dict] | None:
    """The AutoTP layer specs of ``module``'s own plan; None when it declares none (or none of its
    entries shards a linear layer)."""
    plan = getattr(module, "_tp_plan", None) or getattr(module, "tp_plan", None)
    if not isinstance(plan, dict):
        return None
    grouped: dict[str, list[str]] = {}
    for name, style in plan.items():
        kind = _STYLES.get(style)
        if kind is not None:
            grouped.setdefault(kind, []).append(_pattern(name))
    if not grouped:
        return None
    return [{"patterns": patterns, "partition_type": kind} for kind, patterns in sorted(grouped.items())]
