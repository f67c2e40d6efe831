"""What one training run hands to its workers, and what each worker reports back once it is set
up: plain, picklable, free of Hydra objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orch.plans.optim_settings import OptimSettings
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import TrainSpec

if TYPE_CHECKING:  # their torch imports are left to the worker's start-up (TrainWorker.__init__)
    from orch.launchers.engines.base import BuiltModel
    from orch.plans.model.workload import Workload


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """Everything a worker needs to train; built by the driver, pickled to every actor."""

    plan: ResolvedPlan
    optim: OptimSettings
    """The optimizer, lr schedule, clipping and loss scaling every engine trains with
    (:func:`orch.plans.optim_settings.optim_settings`)."""
    workload: Workload
    """The model factory (called inside the worker), objective, data source, tensor-parallel specs
    and pipeline layers (used with plan.pp > 1)."""
    train: TrainSpec
    engine_config: dict | None = None
    """The engine's own config, opaque here: what its driver part's ``engine_config`` built
    (DeepSpeed's JSON, ``optim`` serialized with the plan's ZeRO settings); None for an engine that
    reads ``optim`` and the plan alone (FSDP2)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the worker processes."""
    run_id: str | None = None
    """MLflow run id, recorded with each published checkpoint so a resume continues that run."""
    resume_tag: str | None = None
    """Checkpoint tag (in train.checkpoint_dir) to load before training; None starts fresh."""
    system_metrics_interval_s: float = 0.0
    """Seconds between samples of each node's hardware use (the first worker of a node samples);
    0: none."""
    model_signature: dict | None = None
    """Parameter names and shapes and the model's config, recorded in each checkpoint's manifest
    (:func:`orch.launchers.checkpoint.model_signature`) so a resume can check it fits before launching."""
    mfu_peak_tflops: float | None = None
    """The dense matmul rate per device MFU is reported against, from the cluster profile
    (:func:`orch.plans.step_time.profile.mfu_peak`); None: each worker measures its own as it starts."""


@dataclass(frozen=True, kw_only=True)
class WorkerFacts:
    """One rank, set up: where it runs, where it sits in the grid and what it holds."""

    rank: int
    pid: int
    hostname: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    start_step: int
    """The step it resumed after (0: a fresh start)."""
    model: BuiltModel
    """What its engine built: how, the parameters it holds, the optimizer that steps them."""
    data_tensor_bytes: int
    """Bytes of tensors the data source holds in this process (not the model's)."""
    peak_tflops: float
    """Measured dense matmul throughput in the training precision."""
    torch_threads: int = 0
    """Threads of torch's intra-op pool (:func:`orch.launchers.torch_threads.match_torch_threads`)."""
    node_id: str = ""
    """The Ray node it runs on (set by the worker group, which placed it)."""


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """One rank's report of a logged step: what it measured over the steps since its last report."""

    rank: int
    step: int
    """The optimizer step reported."""
    loss: float
    """The training loss averaged over the steps since the last report and over every rank."""
    local_loss: float
    """The same average over this rank's own batches only."""
    lr: float
    step_time_s: float
    """This rank's mean time per step (forward, backward, optimizer step)."""
    samples_per_s: float
    """This rank's replica's samples per second."""
    tokens_per_s: float | None
    """Its replica's tokens per second, for data with tokens (None otherwise)."""
    epoch: int
    """The data source's epoch after this step."""
    first_batch_digest: str
    """A fingerprint of the first batch this rank trained on (which ranks share data)."""
    evaluation: dict[str, float] = field(default_factory=dict)
    """``eval_loss`` and the objective's own ``eval_<name>`` metrics, at evaluation steps."""
    measured_peak_bytes: int | None = None
    """Peak tensor bytes during the memory-probe step (None at other steps)."""
    measured_state_bytes: int | None = None
    """Tensor bytes held after the memory-probe step (None at other steps)."""
    memory_at_peak: list[dict] | None = None
    """What was alive at the measured peak (``train.memory_probe_detail``), grouped by what made it,
    largest first: :class:`orch.launchers.memory_probe.HeldAtPeak` as dicts."""
    phase_time_s: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step in each phase (forward, backward, optimizer, ...) of the steps sampled
    since the last report (:mod:`orch.launchers.step_phases`); empty when none was."""
    steps: int = 0
    """Optimizer steps this report's ``step_time_s`` is the mean of (those since the last report)."""
    checkpoint_s: float = 0.0
    """Seconds this rank spent writing checkpoints since the last report."""
    eval_s: float = 0.0
    """Seconds this rank spent on this report's evaluation (0 without one)."""
    profiles: list = field(default_factory=list)
    """The steps since the last report that ran under the profiler (``train.profile_steps``):
    :class:`orch.launchers.step_profile.StepProfile`, each with its trace."""

    def named_values(self) -> dict[str, float]:
        """Every value reported, by name (``loss``, ``eval_loss``, ...): what a sweep can optimize."""
        values = {"loss": self.loss, "local_loss": self.local_loss, "lr": self.lr, "step_time_s": self.step_time_s,
                  "samples_per_s": self.samples_per_s, "epoch": self.epoch, **self.evaluation}
        if self.tokens_per_s is not None:
            values["tokens_per_s"] = self.tokens_per_s
        return values


@dataclass(frozen=True, kw_only=True)
class PollStatus:
    """What one rank answers the driver's poll: its new reports and the state of its training."""

    reports: list[StepReport]
    """Reports of the logged steps after those the driver has seen."""
    done: bool
    """Training ended (finished, or failed with ``error``)."""
    error: str | None
    """The traceback of the exception that ended training, if it failed."""
    step: int
    """The last optimizer step this rank finished."""
    milestones: int
    """Progress markers passed (steps and the collectives around them): the lowest is the rank a hang waits for."""
    since_progress_s: float
    """Seconds since this rank last made progress (hang detection)."""
    system: list[dict] = field(default_factory=list)
    """Hardware samples of the node taken since the last poll (only its first worker samples)."""

