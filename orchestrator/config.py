"""The root config schema, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` extend these schemas, so a mistyped key or a wrongly typed value
fails when Hydra composes the config, naming the key. The plan, cluster, optimizer, data and
loop schemas live in :mod:`plans.spec` (pure dataclasses the planner uses directly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from plans.spec import ClusterSpec, DataSpec, OptimSpec, PlanSpec, TrainSpec


@dataclass(kw_only=True)
class GPTModelConfig:
    """The built-in GPT (workloads/gpt.py)."""

    _target_: str = "workloads.gpt.GPT"
    n_layer: int = 2
    """Transformer blocks."""
    d_model: int = 128
    """Hidden size."""
    n_head: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 128
    """Context length (learned positions)."""
    vocab_size: int = 256
    """Vocabulary; the byte-level corpus needs at least 256."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head."""


@dataclass(kw_only=True)
class TrackingConfig:
    """Where the run is recorded."""

    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a local sqlite file by default, or http://host:5000 for a server."""
    experiment: str = "orch"
    """MLflow experiment name."""
    run_name: Optional[str] = None
    """MLflow run name; null lets MLflow pick one."""
    enabled: bool = True
    """false runs without tracking (benchmarks use it as a baseline)."""


@dataclass(kw_only=True)
class RunConfig:
    """The whole declaration of a run: one field per config group, plus the loop."""

    model: Any = MISSING
    """The model: ``_target_`` (a torch.nn.Module class or factory) and its arguments."""
    data: DataSpec = field(default_factory=lambda: DataSpec(seq_len=II("model.seq_len")))
    plan: PlanSpec = field(default_factory=PlanSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    train: TrainSpec = field(default_factory=TrainSpec)


def register_configs() -> None:
    """Register the schemas; the YAML files list them first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="gpt_schema", node=GPTModelConfig)
    cs.store(group="plan", name="plan_schema", node=PlanSpec)
    cs.store(group="cluster", name="cluster_schema", node=ClusterSpec)
    cs.store(group="optim", name="optim_schema", node=OptimSpec)
    cs.store(group="data", name="data_schema", node=DataSpec)
    cs.store(group="tracking", name="tracking_schema", node=TrackingConfig)
