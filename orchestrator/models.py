"""Model construction from its Hydra config; kept light so `orch check` imports no Ray or MLflow."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from hydra.utils import instantiate


def build_model(model_cfg: dict) -> torch.nn.Module:
    """Instantiate the model config's ``_target_`` (on meta in the driver, for real in workers)."""
    return instantiate(model_cfg, _convert_="all")


def model_factory(model_cfg: dict) -> Callable[[], torch.nn.Module]:
    """A picklable zero-argument factory, so workers build the model themselves."""
    return functools.partial(build_model, model_cfg)
