"""Host memory a node needs while its workers build the model, before the first step.

Training memory is not the whole story: a model is built in host memory first, in the dtype its
constructor uses (fp32 for almost every model), and only then is it cast, sharded or moved to a
device. All workers of a node build at the same moment, so a node holds one copy per local
worker of whatever each worker builds:

* under ZeRO-3 without tensor or pipeline parallelism the workers build inside
  ``deepspeed.zero.Init``, which partitions each parameter as it is created: a worker holds its
  ``1/dp`` share (the worker falls back to building whole when the model's code cannot run
  under ``zero.Init``, and says so);
* with pipeline parallelism each stage builds only its own layers (``StageLayer``s);
* the FSDP2 engine builds on ``meta`` on every rank and fills the shards from the whole model
  that the run's first worker alone builds, so the node that hosts it holds one whole copy;
* otherwise, tensor parallelism included (AutoTP shards a model that was built whole), every
  worker builds the whole model.

Weights read from disk (``model.pretrained_path``, ``model.weights_path``) are held as a state
dict beside the built model until they are copied in, so every worker adds their size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orch.plans.errors import Violation
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import ClusterSpec

if TYPE_CHECKING:  # the plan is resolved before torch is imported (orch.run.early_ray)
    from orch.plans.parallel.pipeline import PipelineStage

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class BuildMemory:
    """What one node's host memory holds while its workers build the model."""

    model: int
    """The model as one worker builds it: whole, its ``zero.Init`` share or its pipeline stage."""
    weights: int = 0
    """The weight files one worker reads while building."""
    workers: int
    """Workers building on one node at once."""
    how: str
    """How a worker builds: ``whole``, ``zero.Init share`` or ``pipeline stage``."""
    capacity: int
    builders: int | None = None
    """Workers of the node that build ``model``; None: every one of them."""

    @property
    def per_worker(self) -> int:
        """What a worker that builds the model holds while it does."""
        return self.model + self.weights

    @property
    def total(self) -> int:
        builders = self.workers if self.builders is None else self.builders
        return self.model * builders + self.weights * self.workers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def build_memory(plan: ResolvedPlan, cluster: ClusterSpec, *, built_bytes: int, param_count: int,
                 stages: list[PipelineStage], weight_file_bytes: int = 0) -> BuildMemory:
    """The build-time host memory of ``plan`` on a node of ``cluster``, as its engine builds the
    model (:meth:`orch.plans.engines.base.EngineSpec.build_memory`).

    ``built_bytes`` are the model's parameters and buffers as its constructor creates them;
    ``stages`` the pipeline split (one stage without pipeline parallelism); ``weight_file_bytes``
    the weight files the constructor reads.
    """
    from orch.plans.engines import engine_spec

    return engine_spec(plan.engine).build_memory(plan, cluster, built_bytes=built_bytes, param_count=param_count,
                                                 stages=stages, weight_file_bytes=weight_file_bytes)


def build_violation(build: BuildMemory) -> Violation | None:
    """The refusal of a plan whose model cannot be built on its nodes, or None."""
    if build.fits:
        return None
    read = f" + {format_bytes(build.weights)} of weight files read" if build.weights else ""
    fix = "use fewer workers per node (cluster.devices_per_node) or hosts with more memory"
    if build.how == "whole" and build.builders is None:
        fix = ("use plan.zero_stage=3 (each worker then builds only its share, inside deepspeed.zero.Init) or "
               "plan.engine=fsdp2 (one worker builds it whole, the others on meta), " + fix)
    return Violation(
        "cluster.host_memory_gib", round(build.capacity / GIB, 2),
        f"building the model needs {format_bytes(build.total)} of host memory per node: {_builders(build)} "
        f"the model as built ({build.how}: {format_bytes(build.model)}){read}, "
        f"but a node has {format_bytes(build.capacity)}.",
        fix)


def _builders(build: BuildMemory) -> str:
    if build.builders is None:
        return f"{build.workers} worker(s) each hold"
    return f"{build.builders} of {build.workers} worker(s) holds (the others build on meta)"


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: GiB down to a tenth of one, MiB below, so small parts stay readable."""
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 1024**2:.1f} MiB"
