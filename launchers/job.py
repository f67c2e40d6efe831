"""What one training run hands to its workers, and what each worker reports back once it is set
up: plain, picklable, free of Hydra objects."""

from __future__ import annotations

from dataclasses import dataclass, field

from plans.resolve import ResolvedPlan
from plans.spec import TrainSpec
from plans.workload import Workload


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """Everything a worker needs to train; built by the driver, pickled to every actor."""

    plan: ResolvedPlan
    ds_config: dict
    workload: Workload
    """The model factory (called inside the worker), objective, data source, tensor-parallel specs
    and pipeline layers (used with plan.pp > 1)."""
    train: TrainSpec
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
    (:func:`launchers.checkpoint.model_signature`) so a resume can check it fits before launching."""


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
    params_on_rank: int
    """Parameters this rank's module holds once DeepSpeed has wrapped (and AutoTP sharded) it."""
    params_at_build: int
    """Parameters it held right after building the model (ZeRO-3: only its partition)."""
    built: str
    """How the model was built: ``zero.Init``, ``whole (...)`` or ``stages``."""
    data_tensor_bytes: int
    """Bytes of tensors the data source holds in this process (not the model's)."""
    optimizer_note: str | None
    """Why the optimizer differs from the configured one, if it does."""
    peak_tflops: float
    """Measured dense matmul throughput in the training precision."""
    torch_threads: int = 0
    """Threads of torch's intra-op pool (:func:`launchers.worker.match_torch_threads`)."""
    node_id: str = ""
    """The Ray node it runs on (set by the worker group, which placed it)."""


@dataclass(frozen=True, kw_only=True)
class PollStatus:
    """What one rank answers the driver's poll: its new reports and the state of its training."""

    reports: list[dict]
    """Reports of the logged steps after those the driver has seen (step, loss, throughput, eval_*)."""
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

