"""What the user declares: typed schemas of the plan, the cluster, the optimizer and the loop.

These dataclasses hold declarations only; runtime facts (world size found on the cluster,
parameter counts of the built model) are combined with them by :mod:`orch.plans.resolve`, which
returns a new :class:`orch.plans.resolve.ResolvedPlan`. Hydra registers the same classes as
structured configs, so an unknown or mistyped key fails at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Offload(str, Enum):
    """Where ZeRO keeps a state it moves off the device."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Recompute(str, Enum):
    """What backward recomputes instead of keeping it from the forward (``plan.activation_checkpointing``).

    ``full`` keeps only each repeated block's input and runs the block's forward again in backward;
    ``selective`` keeps the outputs of the matmuls and attention (the costly ops) and recomputes the
    rest (norms, activations, elementwise ops: cheap, and most of the bytes); ``none`` keeps
    everything. True means full, false none: the values the field took before it had a policy.
    Truthy when something is recomputed.
    """

    none = "none"
    selective = "selective"
    full = "full"

    def __bool__(self) -> bool:
        return self is not Recompute.none

    @classmethod
    def of(cls, value: bool | str | Recompute) -> Recompute:
        """The policy ``value`` names (a bool or its YAML spelling, or a policy's name); raises
        ValueError for anything else."""
        if isinstance(value, bool):
            return cls.full if value else cls.none
        text = str(value.value if isinstance(value, Enum) else value).strip().lower()
        spelled = {"true": cls.full, "false": cls.none}
        if text in spelled:
            return spelled[text]
        return cls(text)


class PipelineSchedule(str, Enum):
    """How micro-batches move through the pipeline stages (``plan.pp_schedule``).

    ``gpipe`` runs every forward, then every backward; ``1f1b`` alternates one forward and one
    backward once the pipeline is full (DeepSpeed's schedule; same bubble, less memory);
    ``interleaved_1f1b`` gives each rank ``plan.pp_virtual_stages`` smaller stages, looped
    (rank r holds stages r, r + pp, ...), cutting the bubble by that factor; ``zero_bubble``
    interleaves too and splits each backward into the input's gradient and the weights', filling
    the bubble with the latter; ``zbv`` is the zero-bubble schedule over two stages per rank laid
    out in a V (rank r holds stages r and 2 * pp - 1 - r). The last three are torch's
    (``torch.distributed.pipelining``) and run in the fsdp2 engine.
    """

    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    zero_bubble = "zero_bubble"
    zbv = "zbv"

    @property
    def interleaved(self) -> bool:
        """Each rank runs several stages (``plan.pp_virtual_stages`` > 1)."""
        return self in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble, PipelineSchedule.zbv)

    @property
    def splits_backward(self) -> bool:
        """Backward runs as two passes, the input's gradient first and the weights' later."""
        return self in (PipelineSchedule.zero_bubble, PipelineSchedule.zbv)


@dataclass(kw_only=True)
class FSDPSpec:
    """PyTorch FSDP2's settings (``plan.engine=fsdp2``); parameters, gradients and optimizer
    states are always sharded over the data-parallel ranks, as under ZeRO-3."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again for its
    backward; false keeps them until the backward (one all-gather fewer, more memory held)."""
    hybrid: bool = False
    """Shard within a node and replicate across nodes (HSDP): the all-gathers stay on the node's links."""


class Precision(str, Enum):
    """Training precision; bf16/fp16 keep fp32 master weights in the optimizer. fp8 is bf16 with
    the repeated blocks' linear layers multiplying in FP8 (torchao's float8 training, FSDP2 engine,
    GPUs with FP8 matmuls): parameters, activations and everything else as in bf16."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"

    @property
    def element_bytes(self) -> int:
        """Bytes of one parameter, gradient or activation element in this precision."""
        return 4 if self is Precision.fp32 else 2

    @property
    def dtype(self):
        """The ``torch.dtype`` it trains in (torch imported only when asked): bf16 for fp8, whose
        FP8 casts live inside the matmuls."""
        import torch

        return {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16,
                Precision.fp8: torch.bfloat16}[self]

    @property
    def base(self) -> Precision:
        """The precision its matmul speeds are measured and declared in (bf16 for fp8)."""
        return Precision.bf16 if self is Precision.fp8 else self


class Fp8Recipe(str, Enum):
    """How ``plan.precision=fp8`` scales tensors into FP8 (torchao's recipe names)."""

    tensorwise = "tensorwise"
    """One scale per tensor: the fastest (H100's fast-accumulation kernels)."""
    rowwise = "rowwise"
    """One scale per row: closer to bf16's numerics, a little slower."""


class Accelerator(str, Enum):
    """Kind of device one worker drives."""

    cpu = "cpu"
    gpu = "gpu"


class ResumeMode(str, Enum):
    never = "never"
    auto = "auto"


class OptimizerName(str, Enum):
    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"


@dataclass(kw_only=True)
class PlanSpec:
    """The parallelism plan: how the model and batch are split over the workers."""

    engine: str = "deepspeed"
    """The training engine: deepspeed (ZeRO stages, pipelines), fsdp2 (PyTorch's fully_shard), or
    one registered with :func:`orch.plans.engines.register_engine`."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    """FSDP2's settings; read only when engine is fsdp2."""
    dp: int | None = None
    """Data-parallel degree; null takes what the cluster leaves: world_size / (tp * pp * cp)."""
    tp: int = 1
    """Tensor-parallel degree (layers split across devices)."""
    pp: int = 1
    """Pipeline stages; each optimizer step runs grad_accum_steps micro-batches through them."""
    cp: int = 1
    """Context-parallel degree (FSDP2 engine): each sample's sequence is split over cp ranks, which
    gather each layer's keys and values for attention; activations shrink by cp."""
    pp_partition: str = "parameters"
    """How layers are split into stages (DeepSpeed's PipelineModule partition_method):
    'parameters' balances parameter counts, 'uniform' layer counts, 'type:REGEX' the layers whose
    class name matches (e.g. 'type:Block' balances transformer blocks)."""
    pp_schedule: str = "1f1b"
    """The pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv (see
    :class:`PipelineSchedule`); DeepSpeed runs 1f1b only, the fsdp2 engine all five."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank: 1 for gpipe and 1f1b, 2 or more for interleaved_1f1b and
    zero_bubble, 2 for zbv. The model is cut into pp * pp_virtual_stages stages."""
    zero_stage: int = 0
    """ZeRO stage 0-3: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    offload_optimizer: Offload = Offload.none
    """Keep optimizer states (and the optimizer step) on cpu or nvme instead of the device."""
    offload_param: Offload = Offload.none
    """Keep parameters on cpu or nvme between uses (ZeRO-3 only)."""
    nvme_path: str | None = None
    """Directory for NVMe offload; required when either offload is nvme."""
    activation_checkpointing: bool | str = "none"
    """Recompute activations in backward instead of keeping them: none, selective (keep matmul and
    attention outputs, recompute the cheap ops) or full (keep only each block's input); true/false
    mean full/none. Saves memory, costs compute."""
    recompute_every_n_layers: int = 1
    """With activation_checkpointing on, apply it to every n-th repeated block only (blocks 0, n,
    2n, ... of each model part a rank holds); the others keep their activations. 1: every block.
    Between none's memory and the policy's: 1/n of the blocks' recomputation for about 1/n of the
    activations it saves."""
    micro_batch_size: int = 4
    """Samples per worker per forward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    precision: Precision = Precision.fp32
    """fp32, or bf16/fp16 mixed precision with fp32 master weights; fp8: bf16 with the repeated
    blocks' linear layers multiplying in FP8 (FSDP2 engine, GPUs with FP8 matmuls)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """With precision=fp8: tensorwise or rowwise scaling (torchao's float8 recipes)."""
    compile: bool = False
    """torch.compile each repeated block (FSDP2 engine): its memory-bound ops fused into fewer kernels.
    The first steps wait for the compilation (tens of seconds per block class on a CPU)."""
    sequence_parallel: bool = False
    """With tp > 1, split the residual stream along the sequence as well (FSDP2 engine): norms and
    residual adds run on 1/tp of it, and their activations shrink by tp; the all-reduces become
    all-gathers and reduce-scatters of the same bytes."""
    async_tp: bool = False
    """With sequence parallelism and compile on GPUs (FSDP2 engine): overlap the tensor-parallel
    all-gathers and reduce-scatters with the matmuls that consume and produce them (torch's
    micro-pipelined TP: each such matmul runs in tp chunks as the collective's chunks move through
    symmetric memory). Hides most of the tp term; each matmul runs at 1/tp of its rows."""
    loss_parallel: bool = True
    """With tp > 1 (FSDP2 engine; with pipeline stages, on the last one): split the output head over
    the vocabulary across the tensor-parallel ranks and compute the loss from the split logits
    (torch's loss_parallel), as Megatron-LM's vocabulary-parallel head; false keeps the head, its
    logits and the loss whole on every rank. Needs a head the model names (get_output_embeddings():
    a linear layer of its own, or the built-in GPT's tied head, split with its embedding, at pp=1)
    and a cross-entropy objective (orch.plans.parallel.vocab_parallel); DeepSpeed keeps it whole."""


@dataclass(kw_only=True)
class MatmulRate:
    """Sustained matmul throughput at one matmul height."""

    rows: int
    """Rows of the activation operand (micro-batch x sequence positions)."""
    tflops: float


@dataclass(kw_only=True)
class PhaseObservation:
    """One phase of a finished run's step: what the profile's speeds predicted and what it measured."""

    phase: str
    """The phase group, as `orch report` names it (orch/plans/step_time/phases.py)."""
    predicted_s: float
    """At the profile's measured speeds, before any correction from runs."""
    measured_s: float


@dataclass(kw_only=True)
class RunObservation:
    """A finished run that corrects the profile's predictions (`orch calibrate --from-run RUN_ID`)."""

    run_id: str
    plan: str
    """The run's plan, as `orch runs` prints it."""
    recorded_at: str
    phases: list[PhaseObservation]
    kind: str = ""
    """The plans its corrections apply to first (:func:`orch.plans.step_time.phases.correction_kind`:
    the engine and its settings, where the optimizer steps); '' for a run that did not record it,
    which corrects every plan alike."""
    reference: bool = False
    """Whether `orch calibrate` trained it as one of its reference runs (``calibrate.references``),
    rather than a run a user added with ``--from-run``."""
    phases_version: int = 1
    """Which of the cost model's splits of a step into phases priced it
    (:data:`orch.plans.step_time.phases.PHASES_VERSION`; 1 for a run recorded before the split was
    numbered): a run priced under another split corrects nothing, as its phases held other parts."""
    parts: list[PhaseObservation] = field(default_factory=list)
    """Its last profiled step (``train.profile_steps``; a reference run profiles one) by the parts
    that price each kind of work (``phase`` names the part, as `orch report` does), against the
    profile's uncorrected prediction: which part of a phase its correction stands for. Recorded,
    not applied: corrections stay per phase. Empty when no step was profiled."""


@dataclass(kw_only=True)
class MeasuredSpeeds:
    """A cluster's speeds as `orch calibrate` measured them on its workers: written into the cluster
    profile it creates, and used by `orch check`, `orch tune` and `orch train`'s predicted step
    instead of the declared speeds (see orch/plans/step_time/profile.py). Each number is the
    cost model's :class:`orch.plans.step_time.cost_model.Speeds` field of the same name."""

    precision: Precision
    """The precision the matmuls were timed in; a plan in another precision uses the declared speeds."""
    matmul_tflops: list[MatmulRate]
    """Per worker, by matmul height (the plans' micro-batch x sequence rows)."""
    matmul_shape: list[int]
    """(in, out) features of the matmul timed: the model's largest repeated linear layer."""
    intra_node_gbps: float
    inter_node_gbps: float
    intra_latency_s: float
    inter_latency_s: float
    intra_bus_efficiency: float = 1.0
    inter_bus_efficiency: float = 1.0
    intra_all_gather_share: float = 1.0
    intra_reduce_scatter_share: float = 1.0
    inter_all_gather_share: float = 1.0
    inter_reduce_scatter_share: float = 1.0
    attention_share: float = 1.0
    """Attention's FLOP rate over the matmuls' (``Speeds.attention_share``); 1 in profiles measured
    before it was timed, and for models without attention."""
    host_link_gbps: float
    device_memory_gb_per_s: float
    host_memory_gb_per_s: float
    host_optimizer_params_per_s: float
    op_overhead_s: float
    core_share: float
    measured_at: str
    """When the probes ran (UTC, ISO 8601)."""
    hosts: list[str]
    """The worker hosts, in rank order."""
    nodes: int
    """Ray nodes the workers ran on."""
    workers: int
    versions: dict[str, str] = field(default_factory=dict)
    """orch, torch and Ray versions of the run that measured them."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each speed came from: measured by which probe, or declared (e.g. the inter-node link of
    a single-node cluster, which nothing could measure)."""
    runs: list[RunObservation] = field(default_factory=list)
    """Finished runs priced at these speeds, by phase: each phase group's predicted parts are scaled by
    the median of its measured / predicted over them (orch/plans/step_time/profile.py)."""


@dataclass(kw_only=True)
class ClusterSpec:
    """The target cluster, declared; the live Ray cluster is checked against it at launch."""

    address: str | None = None
    """Ray address: null starts an embedded local Ray; 'auto', 'host:6379' or 'ray://host:10001'."""
    nodes: int = 1
    """Number of nodes the plan uses."""
    devices_per_node: int = 2
    """Workers (one per device) on each node."""
    accelerator: Accelerator = Accelerator.cpu
    """cpu trains with gloo and DS_ACCELERATOR=cpu; gpu uses one GPU per worker and NCCL."""
    device_memory_gib: float = 8.0
    """Memory of one device (on cpu: the share of host memory one worker may use)."""
    host_memory_gib: float = 24.0
    """Host memory of one node (offloaded states of all local workers land here)."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved for each worker."""
    object_store_memory_gib: float = 1.0
    """Object store of the embedded Ray (ignored when joining a cluster)."""
    wait_s: float = 60.0
    """How long to wait for the cluster to grant the workers' resources before failing."""
    connect_timeout_s: float = 30.0
    """With an address, how long the cluster may take to answer before the command fails (exit 2)
    instead of waiting on Ray's own retries (about 14 minutes for an address nobody answers); and
    how long each check of a storage URI (train.checkpoint_dir, tune.out, data.paths) and the
    first request to a tracking server (`orch train`, `orch submit`) may take."""
    discover: bool = True
    """With an address, `orch check` reads nodes and memory from the live cluster instead of
    trusting the declared numbers."""
    # The speeds below feed only `orch tune`'s cost model. Each one left unset (null) takes the
    # accelerator's default (orch/plans/step_time/cost_model.py DECLARED_SPEEDS: a CPU core's, or an A100's), so
    # switching cluster.accelerator switches every speed not set; a speed that is set is kept.
    device_tflops: float | None = None
    """Peak dense matmul TFLOP/s of one device at the plan's precision (A100: 312 bf16, 19.5 fp32;
    unset on gpu: those two by the plan's precision). `orch tune` predicts compute time from it
    unless it measured the live cluster."""
    intra_node_gbps: float | None = None
    """Gbit/s each device can send to the others of its node (NVLink, or shared memory on CPU)."""
    inter_node_gbps: float | None = None
    """Gbit/s each device can send to other nodes (its share of the node's network)."""
    host_link_gbps: float | None = None
    """Gbit/s between a device and its host's memory (PCIe; offloaded states cross it every step)."""
    device_memory_gb_per_s: float | None = None
    """Memory bandwidth of one device in GB/s (the optimizer step is bound by it)."""
    host_memory_gb_per_s: float | None = None
    """Memory bandwidth of one node's host memory in GB/s, shared by its workers' CPU optimizers."""
    device_fp8_tflops: float | None = None
    """Peak dense FP8 matmul TFLOP/s of one device (H100 SXM and H200: 1979); null: the device has
    no FP8 matmuls (an A100), and plan.precision=fp8 is refused."""
    device_sm_count: int | None = None
    """Streaming multiprocessors of one GPU (A100 108, H100 SXM 132): `orch tune` prices each
    matmul by the waves of output tiles they run (null: an A100's on gpu; none on cpu)."""
    device_hour_usd: float | None = None
    """Price of one device for one hour; `orch tune` then prices each plan's time to train
    (null: no cost column)."""
    mtbf_hours: float | None = None
    """Mean time between failures of one node, in hours: `orch tune` then predicts each plan's time to
    train with the checkpoints, restarts and lost work failures cost, and the checkpoint interval that
    minimizes it (Young/Daly; null: failures not priced)."""
    storage_gb_per_s: float = 1.0
    """GB/s one node writes (and reads) a checkpoint at: the predicted save time with mtbf_hours."""
    restart_s: float = 300.0
    """Seconds a restart takes before training resumes (rescheduling, start-up, loading the checkpoint):
    priced with mtbf_hours; a run's goodput/restart_s and goodput/startup_s measure yours."""
    measured: MeasuredSpeeds | None = None
    """Speeds measured on this cluster by `orch calibrate` (the profile it writes sets them); used
    instead of the declared speeds above. null: the declared ones."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(kw_only=True)
class OptimSpec:
    """Optimizer and learning-rate schedule."""

    name: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    momentum: float = 0.0
    """SGD momentum (0 keeps no momentum buffer)."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr; then cosine decay to min_lr_ratio * lr at train.steps."""
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""


@dataclass(kw_only=True)
class ElasticSpec:
    """What a run does when it loses devices (``train.elastic``): re-plan for the survivors and resume
    from the last checkpoint, instead of waiting for a replacement (or a person) that may not come."""

    enabled: bool = False
    """On a lost worker, wait wait_s for the plan's devices, then re-plan for the devices left (off:
    restart at the same size, as train.max_failures allows)."""
    min_devices: int = 1
    """The fewest surviving devices worth training on; fewer end the run."""
    wait_s: float = 30.0
    """How long a replacement may take to arrive (the whole group placed again) before the re-plan."""
    batch_tolerance: float = 0.0
    """How far the global batch may move when the survivors cannot hold it exactly, as a share of it
    (0: exactly the run's batch, through accumulation)."""
    scale_up: bool = True
    """Return to the declared plan at the next checkpoint once the cluster has its devices again."""
    replan_timeout_s: float = 120.0
    """A bound on the re-plan's search (the tuner's, on the surviving devices)."""
    exclude_stragglers: bool = False
    """Re-plan without the node of a rank named a straggler, at the next checkpoint."""


@dataclass(kw_only=True)
class TrainSpec:
    """The training loop."""

    steps: int = 200
    """Optimizer steps to run."""
    log_every: int = 10
    """Report and track metrics every this many steps."""
    eval_every: int = 0
    """Evaluate on held-out data every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Micro-batches per evaluation."""
    seed: int = 1234
    global_batch_size: int | None = None
    """Samples per optimizer step; null means micro_batch_size * grad_accum_steps * dp."""
    tokens: int | None = None
    """The token budget of the whole training, for `orch tune`'s predicted time to train and its
    cost; null: steps * global batch * sequence. A run still stops after `steps`."""
    memory_probe_step: int = 2
    """Measure every worker's real peak tensor memory during this step (0 disables); later
    steps run unobserved, at full speed."""
    memory_probe_detail: bool = False
    """Also say what was alive at that peak (CPU workers): each rank's tensor memory grouped by what
    made it (parameters, gradients, what the step began with, then operator, forward or backward, and
    module), as memory/at_peak/rank<r>.json in the MLflow run, the largest printed."""
    profile_steps: list[int] = field(default_factory=list)
    """Run these steps under torch's profiler on every rank: each rank's trace (Chrome JSON, gzipped)
    goes to the MLflow run under profile/, and the time by kind of work (matmul, attention, element-wise,
    communication, copies, optimizer) is logged and printed. A profiled step is left out of the step time."""
    checkpoint_every: int = 0
    """Write a DeepSpeed checkpoint every this many steps, and at the last step (0: never)."""
    async_checkpoint: bool = False
    """Write checkpoints in the background where the engine can (FSDP2: DCP's async_save): the step waits
    only while the state is copied to host memory; the checkpoint is published (resumable) once written, at
    the next checkpoint, and the last one at once. DeepSpeed: its files copied to host memory, written by a thread."""
    checkpoint_dir: str = "checkpoints"
    """Where checkpoints go: a path (shared by every node of a multi-node run) or a URI of object
    storage (s3://bucket/run, gs://..., file:///...), whose credentials come from the environment."""
    export: bool = True
    """At the end of a run, log the trained model to it: consolidated weights in the model's own format
    and an MLflow model (data-parallel plans; see `orch export` for a checkpoint)."""
    keep_checkpoints: int = 2
    """Published checkpoints kept; older ones are deleted."""
    resume: ResumeMode = ResumeMode.never
    """auto: continue from the latest checkpoint in checkpoint_dir (same MLflow run) if there is one."""
    max_failures: int = 0
    """Restarts of the whole worker group from the latest checkpoint after a worker fails."""
    force: bool = False
    """Launch even when the planner predicts the plan does not fit (prints a warning): a decision
    about this launch, not part of the plan."""
    hang_timeout_s: float = 900.0
    """A rank that finishes no optimizer step for this long is declared hung: every rank's
    stack is saved to the MLflow run, then the group restarts or fails (0 disables)."""
    straggler_threshold: float = 0.2
    """A rank is named a straggler when, in the first phase of the step where the ranks differ, it
    takes longer than their median by more than this share of the median step time, for
    straggler_reports reports in a row (a warning, an MLflow tag and events/stragglers.txt; 0: never).
    A step phase slower than the plan's prediction allows (its P90, plus this share of the predicted step)
    is named the same way, when the prediction is priced at measured speeds (`orch calibrate`)."""
    straggler_reports: int = 3
    """Reports in a row a rank must be the slow one in the same phase before it is named."""
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    """Re-plan for the surviving devices when a node is lost (off by default)."""
    setup_timeout_s: float = 1800.0
    """The same for the workers' setup before the first step: rendezvous, DeepSpeed's JIT op
    builds (minutes on a fresh machine), model construction and checkpoint loading (0 disables)."""
    sweep_metric: str = "eval_loss"
    """The final metric `orch train` returns to Hydra, which optimizing sweepers (Optuna) minimize."""
