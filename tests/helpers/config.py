"""The real composed config, shrunk for CPU runs."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from orch.config import register_configs

REPO = Path(__file__).resolve().parents[2]
# Small enough that a 2-worker run takes seconds on 2 cores, big enough for the loss to fall.
FAST = ["train.steps=30", "train.log_every=5", "train.eval_batches=2", "plan.micro_batch_size=4"]


def compose_config(*overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def lm_inputs(seq_len: int):
    """What the planner measures a language model with: windows of ``seq_len`` byte tokens and
    next-token cross-entropy (the default data source and objective)."""
    from orch.plans.model.workload import Workload
    from orch.workloads.corpus import CorpusSource
    from orch.workloads.objectives import CausalLM

    return Workload(model_factory=lambda: None, objective=CausalLM(), data=CorpusSource(seq_len=seq_len))


def gpu_plan(**declared):
    """A resolved bf16 GPU plan, data-parallel by default, with ``world_size`` made to agree with
    the degrees given (the cost model's tests declare only what they vary)."""
    from orch.plans.resolve import ResolvedPlan
    from orch.plans.spec import Accelerator, Offload, Precision

    fields = dict(dp=8, tp=1, pp=1, zero_stage=0, offload_optimizer=Offload.none, offload_param=Offload.none,
                  nvme_path=None, activation_checkpointing=False, micro_batch_size=1, grad_accum_steps=1,
                  precision=Precision.bf16, accelerator=Accelerator.gpu) | declared
    return ResolvedPlan(**fields, world_size=fields["dp"] * fields["tp"] * fields["pp"])
