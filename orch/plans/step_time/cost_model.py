"""Predicted time of one optimizer step for a resolved plan: compute, bubble, communication, offload.

Pure and cheap (microseconds per plan), so the tuner can rank thousands of plans. The model:

- **compute**: the model's training FLOPs, *counted* on ``meta`` (:mod:`orch.plans.step_time.flops`, recomputation
  included under activation checkpointing), split over ``tp`` and over the pipeline stages as
  DeepSpeed splits whole layers (the busiest stage runs ``ceil(layers / pp)`` of them), at the
  device's sustained matmul throughput for the micro-batch's matmul height; plus a fixed cost per
  operation (counted on ``meta`` too) times the operations of each micro-batch, which is why many
  small micro-batches are slower than few large ones where ops run synchronously (CPU workers).
  Attention's FLOPs run at their own rate, a measured share of the matmuls' (``Speeds.attention_share``).
  On GPUs with a known SM count each GEMM is priced at its shape (:func:`matmul_efficiency`):
  waves of output tiles over the SMs, and a roofline against memory bandwidth for thin ones.
- **memory-bound kernels**: the bytes the kernels between the matmuls read and write (norms,
  softmax, activations, dropout, residual adds, casts, the loss; :mod:`orch.plans.step_time.memory_traffic`),
  counted on ``meta`` at tp=1 and on a 2-way shard, so the part tensor parallelism divides is
  known, at the device's sustained memory bandwidth.
- **end stages**: the work outside the repeated layers is not split over the stages: the last
  stage runs the head and the loss, the first the embedding, and the busier of the two paces the
  schedule (:func:`_busiest_stage`).
- **matmuls tensor parallelism leaves whole**: a layer the model's tensor-parallel plan does not
  split (an output head, replicated by DeepSpeed AutoTP and by DTensor plans without a
  vocabulary-parallel loss) runs whole on every tp rank: its FLOPs are the difference between the
  GEMMs recorded on the model's tp shard and 1/tp of the unsharded model's
  (:func:`tp_whole_flops`), on the stage that holds it.
- **pipeline bubble**: 1F1B with ``m = grad_accum_steps`` micro-batches idles ``pp - 1`` whole
  micro-batch times (compute, memory-bound kernels, tensor-parallel all-reduces and the blocking
  transfers of DeepSpeed's pipeline engine), on devices of their own. Workers that time-share a
  CPU node's cores (``Speeds.core_share`` < 1) lose less: a stage idle in the fill or drain gives
  its cores to the busy ones, and cores sit idle only while fewer stages are busy than the cores
  can serve (:func:`bubble_micro_batches`). The other schedules of the fsdp2 engine idle their
  share of that (:func:`schedule_share`; :mod:`orch.plans.parallel.schedules` gives each schedule's
  bubble and where it comes from), and an interleaved one sends every micro-batch across all
  ``pp * pp_virtual_stages`` stage boundaries.
- **tensor parallelism**: one all-reduce of a row-parallel layer's output in forward and one of a
  column-parallel layer's input gradient in backward (DeepSpeed AutoTP's ``RowParallel`` /
  ``ColumnParallel``), again in the recomputed forward; sizes read off the model on ``meta``.
  Async TP (``plan.async_tp``: compiled, sequence-parallel, on GPUs) overlaps them with the
  matmuls that consume and produce them, chunk by chunk: 1/tp of the traffic stays exposed, plus
  whatever outlasts the matmuls, and the matmuls run as tp GEMMs of 1/tp of the rows each.
- **data parallelism** by ZeRO stage (DeepSpeed 0.19; the plan's :mod:`orch.plans.engine_settings` settings):
  stage 0 all-reduces the gradients once per step (a ring all-reduce, 2(n-1)/n of the
  bytes). Stages 1 and 2 share one optimizer (``runtime/zero/stage_1_and_2.py``), which also
  *all-reduces* the gradient buckets (``allreduce_and_scatter`` -> ``allreduce_bucket``) and keeps
  its partition, then all-gathers the updated parameters after the step (``all_gather_dp_groups``):
  stage 1 reduces once per step, stage 2 every micro-batch (its backward hooks reduce as gradients
  arrive). Stage 3 reduce-scatters every micro-batch and gathers every parameter module in forward
  and in backward of every micro-batch.
- **pipeline point to point**: each micro-batch sends one boundary activation forward and its
  gradient back, split over the tensor-parallel ranks and all-gathered by the receiving stage.
- **offload**: gradients down and parameters up over the host link, and the CPU optimizer bound by
  the threads of the worker's CPU reservation or by the node's memory bandwidth shared by its
  workers, whichever is slower (:func:`host_optimizer_s`); ZeRO-3 parameter offload fetches every
  parameter over the host link for each gather. Without offload the optimizer step is bound by the
  device's memory bandwidth.

Every collective is an alpha-beta cost: a latency per ring step plus bytes over the bus bandwidth
NCCL reaches on the link it crosses, intra-node or inter-node, from the rank layout (tp innermost,
then pp, then dp: :func:`orch.plans.parallel.rank_layout.parallel_coords`); a ring across nodes with several
members on each node runs one channel per network adapter (:meth:`Speeds.bus_gbps`). The optimizer
step is bound by memory bandwidth, DeepSpeed's mixed-precision casts and the clipping norm included.
Communication does not overlap compute (tensor parallel all-reduces are synchronous, and CPU plans
run with ``overlap_comm`` off), so the parts add up. GPU plans overlap the gradient reduction with
backward (``EngineSettings.overlap_comm``), which this model does not credit: their data-parallel
time is an upper bound.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from orch.plans.engine_settings import ZeroStage, engine_settings
from orch.plans.parallel.rank_layout import group_stride
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, ClusterSpec, Offload, OptimizerName, OptimSpec, Precision, Recompute

# A large dense GEMM sustains about 80% of the datasheet peak on A100s (cuBLAS bf16 at
# 8192^3 reaches 250-270 of 312 TFLOP/s); declared peaks are derated by this, measured ones not.
DECLARED_MATMUL_EFFICIENCY = 0.8
# Memory-bound kernels (and a large copy) sustain about 84% of the datasheet bandwidth: 2.81 of an
# H100's 3.35 TB/s in this project's calibration copy (bench/results/gpu_smoke-*.md), 1.7 of an
# A100 80 GB's 2.04 TB/s in STREAM-like copies. Declared bandwidths are derated by this, measured ones not.
DECLARED_MEMORY_EFFICIENCY = 0.84
# The bus bandwidth NCCL's large all-reduces reach, as a share of the link's datasheet rate
# (nccl-tests' busbw = algbw x 2(n-1)/n): about 230 of NVLink 3's 300 GB/s per direction on 8
# A100s behind NVSwitch, and about 23 of an HDR InfiniBand adapter's 25 GB/s across nodes.
# Declared link speeds are derated by these, measured ones (calibration times all-reduces) not.
DECLARED_BUS_EFFICIENCY = {"intra": 0.78, "inter": 0.93}
# Latency of one step of a ring collective (an all-reduce takes 2(n-1) of them) when it is not
# measured: NCCL's own cost model (src/graph/tuning.cc, hwLat of the ring's Simple protocol, the
# one large messages use) charges 3.4 us per step over NVLink and 9.6 us across the network.
DECLARED_LATENCY_S = {"intra": 3.4e-6, "inter": 9.6e-6}
# Fixed cost per operation when not measured: hidden by asynchronous launches on GPUs; on a CPU
# worker, torch's dispatch plus autograd bookkeeping take tens of microseconds per op.
DECLARED_OP_OVERHEAD_S = {"gpu": 0.0, "cpu": 20e-6}
# The speeds a cluster leaves unset (null), by accelerator. cpu: order of magnitude for one core of
# a laptop or small server (calibration measures the real ones whenever Ray is used). gpu: an
# A100 80 GB in a DGX A100, the numbers of the a100_8x cluster preset, which says where each comes
# from. A GPU declared over the CPU preset (cluster.accelerator=gpu) thus gets GPU speeds, not a
# CPU core's memory bandwidth under a GPU's TFLOP/s.
DECLARED_SPEEDS: dict[str, dict[str, float]] = {
    "cpu": {"device_tflops": 0.1, "intra_node_gbps": 40.0, "inter_node_gbps": 10.0, "host_link_gbps": 80.0,
            "device_memory_gb_per_s": 5.0, "host_memory_gb_per_s": 10.0},
    "gpu": {"device_tflops": 312.0, "intra_node_gbps": 2400.0, "inter_node_gbps": 200.0, "host_link_gbps": 256.0,
            "device_memory_gb_per_s": 2039.0, "host_memory_gb_per_s": 409.0},
}
# Parameters per second one CPU thread updates with Adam in fp32 when calibration has not measured
# it: torch's fused CPU AdamW 599 M and DeepSpeed's CPU Adam 584 M on one core of the AMD EPYC these
# tests run on (32M parameters, best of 5 steps). An offloaded optimizer gets the threads of its
# worker's CPU reservation: Ray sets OMP_NUM_THREADS to an actor's num_cpus, and both optimizers
# run that many OpenMP threads.
DECLARED_CPU_ADAM_PARAMS_PER_THREAD_S = 0.6e9
# Host time DeepSpeed's ZeRO-3 spends per parameter-owning module each time it fetches one (the
# forward, the backward, and the recomputed forward with checkpointing): its coordinator's
# pre- and post-module hooks (``runtime/zero/partitioned_param_coordinator.py``), which the step
# waits for even with nothing to gather (dp=1). Measured as ZeRO-3's step time over ZeRO-2's on one
# rank, per module and pass: cpu, 0.43 ms on this project's CPU machines (the built-in GPT with 8
# layers of width 64, 51 modules: 88.9 against 45.2 ms); gpu, 0.58 ms, the mean of this project's
# H100 check (bench/results/gpu_smoke-*.md: GPT-1B 0.280 and 0.325 s against 0.159 and 0.165 s,
# 123 modules; Llama-1.1B 0.461 against 0.221 s, 201 modules).
DECLARED_ZERO3_MODULE_S = {"cpu": 0.43e-3, "gpu": 0.58e-3}
# Streaming multiprocessors of one device when the cluster leaves ``device_sm_count`` unset: an
# A100's 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020; an H100 SXM has 132).
# A CPU has none: its matmuls keep the flat rate by height that calibration measures.
DECLARED_SM_COUNT = {"cpu": 0, "gpu": 108}
# The output tiles one thread block of a bf16/fp16 tensor-core GEMM computes, among which cuBLAS's
# heuristic picks per shape: its A100 kernels are named ``ampere_bf16_s16816gemm_bf16_{128x128,
# 128x256, 256x128}_...`` and its H100 ones ``sm90_xmma_gemm_..._tilesize{128x128, 128x256,
# 256x128}x64``, CUTLASS's defaults for sm80/sm90 the same. Each SM runs one such tile at a time,
# so a GEMM runs in waves of ``sm_count`` tiles (CUTLASS's and NVIDIA's "wave quantization").
DECLARED_MATMUL_TILES = ((128, 256), (256, 128), (128, 128))


# A GPU's matmuls in an fp32 plan: torch leaves TF32 off for them (torch.backends.cuda.matmul.allow_tf32
# is False by default) and orch does not turn it on, so they run at plain FP32's rate, 19.5 TFLOP/s on
# the A100 of the GPU defaults (NVIDIA A100 datasheet), not its 312 of bf16 on tensor cores. A CPU's
# declared rate is an order of magnitude for any precision.
DECLARED_FP32_TFLOPS = {"gpu": 19.5}


def speed_defaults(cluster: ClusterSpec, precision: Precision | None = None) -> dict[str, float]:
    """The speeds ``cluster`` leaves unset, each with its accelerator's default (for an fp32 plan
    on GPUs, their fp32 matmul rate)."""
    defaults = dict(DECLARED_SPEEDS[cluster.accelerator.value])
    if precision == Precision.fp32 and cluster.accelerator.value in DECLARED_FP32_TFLOPS:
        defaults["device_tflops"] = DECLARED_FP32_TFLOPS[cluster.accelerator.value]
    return {name: value for name, value in defaults.items() if getattr(cluster, name) is None}


def declared_speed_values(cluster: ClusterSpec, precision: Precision | None = None) -> dict[str, float]:
    """Every declared speed of ``cluster``: as set, or its accelerator's default where unset."""
    return {name: getattr(cluster, name) for name in DECLARED_SPEEDS["cpu"]} | speed_defaults(cluster, precision)


def fp8_speedup(cluster: ClusterSpec) -> float:
    """``cluster.device_fp8_tflops`` over the device's declared bf16 rate (the datasheets' dense
    numbers: 2 on an H100), 0 where the cluster declares no FP8 matmuls, no bf16 rate to set them
    against (a default is another GPU's), or is not a GPU cluster."""
    if not cluster.device_fp8_tflops or cluster.device_tflops is None or cluster.accelerator != Accelerator.gpu:
        return 0.0
    return cluster.device_fp8_tflops / declared_speed_values(cluster, Precision.bf16)["device_tflops"]


def host_threads(cluster: ClusterSpec) -> int:
    """Threads a worker's host-side work (an offloaded optimizer step) runs: Ray sets
    ``OMP_NUM_THREADS`` to the whole CPUs an actor reserves, and at least 1."""
    return max(1, int(cluster.cpus_per_worker))


COLLECTIVE_SHARES = ("intra_all_gather_share", "intra_reduce_scatter_share", "inter_all_gather_share",
                     "inter_reduce_scatter_share")
"""The :class:`Speeds` fields that price an all-gather or a reduce-scatter against the link's all-reduce."""


@dataclass(frozen=True, kw_only=True)
class Speeds:
    """How fast the devices and links of a cluster are: declared, or measured by calibration."""

    matmul_tflops: tuple[tuple[int, float], ...]
    """Sustained TFLOP/s by matmul height (rows): ((rows, tflops), ...) sorted by rows; between
    points the nearest lower one applies (a single point: the same for every height)."""
    intra_node_gbps: float
    inter_node_gbps: float
    intra_latency_s: float
    inter_latency_s: float
    host_link_gbps: float
    device_memory_gb_per_s: float
    host_memory_gb_per_s: float
    op_overhead_s: float = 0.0
    """Fixed cost of one operation (kernel launch and dispatch). GPUs launch asynchronously and
    hide it behind long kernels (declared 0); CPU workers run every op synchronously."""
    core_share: float = 1.0
    """The share of a core each worker gets while all of its node's workers compute: 1 for GPUs and
    for CPU nodes with a core per worker thread, 0.5 for 4 one-thread workers on 2 cores."""
    memory_efficiency: float = 1.0
    """Share of ``device_memory_gb_per_s`` that memory-bound kernels sustain: 1 when it was measured
    (the calibration's copy is such a kernel), DECLARED_MEMORY_EFFICIENCY of a datasheet number."""
    intra_bus_efficiency: float = 1.0
    """Share of ``intra_node_gbps`` an all-reduce reaches as bus bandwidth: 1 when measured (the
    calibration's all-reduce gives the bus bandwidth), DECLARED_BUS_EFFICIENCY of a datasheet rate."""
    inter_bus_efficiency: float = 1.0
    """The same for ``inter_node_gbps``."""
    intra_all_gather_share: float = 1.0
    """Bus bandwidth of an all-gather (``all_gather_into_tensor``, as FSDP2 and ZeRO gather
    parameters) inside a node, as a share of the all-reduce's: 1 where both run at the link's rate
    (NCCL's rings, and every declared link); measured by calibration, where gloo's is far lower."""
    intra_reduce_scatter_share: float = 1.0
    """The same for a reduce-scatter (``reduce_scatter_tensor``, as FSDP2 and ZeRO-3 reduce gradients)."""
    inter_all_gather_share: float = 1.0
    """:attr:`intra_all_gather_share` across nodes."""
    inter_reduce_scatter_share: float = 1.0
    """:attr:`intra_reduce_scatter_share` across nodes."""
    attention_share: float = 1.0
    """FLOP rate of ``scaled_dot_product_attention`` (forward and backward, its FLOPs counted as the
    FLOP counter counts them: :attr:`ModelCost.attention_forward_flops_per_sample`) as a share of the
    matmul rate at the same rows: 1 declared (attention priced as matmuls); measured by calibration
    at the model's attention shape (a CPU's flash kernel ran at about half its matmuls' rate)."""
    sm_count: int = 0
    """Streaming multiprocessors of one device: the tiles a GEMM runs at once. 0 (CPUs, and speeds
    measured without it) prices every matmul at ``matmul_tflops`` whatever its shape."""
    matmul_tiles: tuple[tuple[int, int], ...] = DECLARED_MATMUL_TILES
    """Output tiles (rows, columns) a GEMM kernel may use, one per SM at a time (:func:`gemm_seconds`)."""
    host_optimizer_params_per_s: float = 0.0
    """Parameters per second one worker's offloaded optimizer updates on the host (Adam in fp32,
    with the threads of the worker's CPU reservation): measured by calibration on GPU workers,
    else the declared rate per thread times ``cluster.cpus_per_worker``. 0 (speeds stored before
    it existed) leaves only the host's memory bandwidth to bound the step."""
    phase_scale: tuple[tuple[str, float], ...] = ()
    """(phase group, factor) pairs: a cluster profile's corrections from finished runs, applied to the
    parts each phase group holds (:func:`orch.plans.step_time.phases.scaled_step`); none by default."""
    source: str = "declared"
    """'declared' (from the cluster config) or 'measured' (calibrated on the live cluster)."""
    fp8_speedup: float = 0.0
    """How many times faster a matmul runs in FP8 than in bf16 (``cluster.device_fp8_tflops`` over
    the bf16 rate; declared even where the rest was measured); 0: the device has no FP8 matmuls."""

    def tflops_at(self, rows: int) -> float:
        heights = [r for r, _ in self.matmul_tflops]
        i = max(bisect.bisect_right(heights, rows) - 1, 0)
        return self.matmul_tflops[i][1]

    @classmethod
    def declared(cls, cluster: ClusterSpec, precision: Precision | None = None) -> Speeds:
        """The cluster's speeds as declared, its accelerator's defaults (at ``precision``) where it
        declares none."""
        speeds = declared_speed_values(cluster, precision)
        return cls(matmul_tflops=((1, speeds["device_tflops"] * DECLARED_MATMUL_EFFICIENCY),),
                   intra_node_gbps=speeds["intra_node_gbps"], inter_node_gbps=speeds["inter_node_gbps"],
                   intra_latency_s=DECLARED_LATENCY_S["intra"], inter_latency_s=DECLARED_LATENCY_S["inter"],
                   host_link_gbps=speeds["host_link_gbps"], device_memory_gb_per_s=speeds["device_memory_gb_per_s"],
                   host_memory_gb_per_s=speeds["host_memory_gb_per_s"],
                   host_optimizer_params_per_s=DECLARED_CPU_ADAM_PARAMS_PER_THREAD_S * host_threads(cluster),
                   op_overhead_s=DECLARED_OP_OVERHEAD_S[cluster.accelerator.value],
                   sm_count=(cluster.device_sm_count if cluster.device_sm_count is not None
                             else DECLARED_SM_COUNT[cluster.accelerator.value]),
                   fp8_speedup=fp8_speedup(cluster),
                   **({"memory_efficiency": DECLARED_MEMORY_EFFICIENCY,
                       "intra_bus_efficiency": DECLARED_BUS_EFFICIENCY["intra"],
                       "inter_bus_efficiency": DECLARED_BUS_EFFICIENCY["inter"]}
                      if cluster.accelerator == Accelerator.gpu else {}))

    def bus_gbps(self, link: str, members_per_node: int = 1, collective: str = "all_reduce") -> float:
        """Bus bandwidth (Gbit/s per rank) of a ring ``collective`` ('all_reduce', 'all_gather' or
        'reduce_scatter') over ``link``.

        Inside a node: the NVLink (or shared-memory) rate NCCL reaches. Across nodes a ring
        passes every node once per channel, and NCCL runs one channel per network adapter, so a
        group with ``members_per_node`` ranks on each node moves that many adapters' worth
        (each rank's share of the node's network, ``inter_node_gbps``), never more than the
        links inside the node carry.
        """
        intra = self.intra_node_gbps * self.intra_bus_efficiency * self.collective_share("intra", collective)
        if link == "intra":
            return intra
        return min(intra, members_per_node * self.inter_node_gbps * self.inter_bus_efficiency
                   * self.collective_share("inter", collective))

    def collective_share(self, link: str, collective: str) -> float:
        """How much of ``link``'s all-reduce bus rate ``collective`` reaches (1 for the all-reduce)."""
        if collective == "all_reduce":
            return 1.0
        if collective not in ("all_gather", "reduce_scatter"):
            raise ValueError(f"unknown collective {collective!r}")
        return getattr(self, f"{link}_{collective}_share")

    @property
    def sustained_memory_gb_per_s(self) -> float:
        return self.device_memory_gb_per_s * self.memory_efficiency


@dataclass(frozen=True)
class Gemm:
    """One matmul shape of a training pass at micro-batch 1: ``batch`` products of an (m x k) by
    a (k x n) matrix. ``grows`` names the dimension that the micro-batch multiplies ('batch',
    'm', 'n', 'k'; '' for none): the tokens of a linear layer's input, or the samples of a
    batched attention product."""

    batch: int
    m: int
    n: int
    k: int
    grows: str = ""

    def at(self, micro_batch: int) -> tuple[int, int, int, int]:
        """(batch, m, n, k) at ``micro_batch`` samples."""
        dims = {"batch": self.batch, "m": self.m, "n": self.n, "k": self.k}
        if self.grows:
            dims[self.grows] *= micro_batch
        return dims["batch"], dims["m"], dims["n"], dims["k"]


def wave_efficiency(batch: int, m: int, n: int, sm_count: int, tile: tuple[int, int]) -> float:
    """Share of the SMs' tile slots a GEMM's output keeps busy: its tiles over the waves they take.

    ``batch * ceil(m / rows) * ceil(n / cols)`` tiles run ``sm_count`` at a time; the last wave
    leaves the rest idle (partial tiles at the edges compute a whole tile's time too).
    """
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


def gemm_seconds(batch: int, m: int, n: int, k: int, *, flops_per_s: float, bytes_per_s: float, sm_count: int,
                 tiles: tuple[tuple[int, int], ...], element_bytes: int) -> float:
    """Time of one GEMM: the slower of its FLOPs and its bytes (a roofline).

    Compute: ``2 b m n k`` FLOPs at ``flops_per_s`` (the sustained rate a large GEMM reaches) times
    the wave efficiency of the best tile, as cuBLAS's heuristic picks the kernel per shape.
    Memory: both operands read and the output written once, ``b (m k + k n + m n)`` elements at
    the device's sustained bandwidth, which a thin GEMM (few rows, or a short reduction) cannot hide.
    """
    waves = max(wave_efficiency(batch, m, n, sm_count, tile) for tile in tiles)
    compute = 2 * batch * m * n * k / (flops_per_s * waves)
    memory = element_bytes * batch * (m * k + k * n + m * n) / bytes_per_s
    return max(compute, memory)


def matmul_efficiency(gemms: tuple[tuple[Gemm, int], ...], micro_batch: int, speeds: Speeds, *,
                      flops_per_s: float, element_bytes: int) -> float:
    """The FLOP-weighted share of the sustained matmul rate a pass's GEMMs reach at ``micro_batch``
    (1 when the device has no SM count or the pass recorded no GEMM): their FLOPs over the time
    :func:`gemm_seconds` gives them, divided by the sustained rate ``flops_per_s``."""
    if speeds.sm_count <= 0 or not gemms:
        return 1.0
    rate = flops_per_s
    bandwidth = speeds.sustained_memory_gb_per_s * 1e9
    flops = seconds = 0.0
    for gemm, count in gemms:
        b, m, n, k = gemm.at(micro_batch)
        flops += count * 2 * b * m * n * k
        seconds += count * gemm_seconds(b, m, n, k, flops_per_s=rate, bytes_per_s=bandwidth,
                                        sm_count=speeds.sm_count, tiles=speeds.matmul_tiles,
                                        element_bytes=element_bytes)
    return flops / (seconds * rate) if seconds > 0 else 1.0


@dataclass(frozen=True, kw_only=True)
class ModelCost:
    """What the cost model needs to know about the model, counted on ``meta``
    (:func:`orch.plans.step_time.model_cost.measure_model_cost`)."""

    seq_len: int
    """Tokens per sample (1 for data without tokens): the rows one sample adds to the matmuls."""
    flops_per_sample: int
    """Forward + loss + backward FLOPs of one sample."""
    flops_per_sample_checkpointed: int
    """The same with activation checkpointing (the recomputed forward included)."""
    param_count: int
    tp_param_count: dict[int, int]
    """Parameters one rank holds at each tensor-parallel degree the search may use."""
    row_parallel_out_per_sample: int
    """Elements all-reduced in forward per sample: outputs of the row-parallel layers."""
    row_parallel_layers: int
    column_parallel_in_per_sample: int
    """Elements all-reduced in backward per sample: inputs of the column-parallel layers."""
    column_parallel_layers: int
    boundary_per_sample: int
    """Elements of one layer's output per sample: what crosses a pipeline stage boundary."""
    n_layers: int
    """Repeated layers (the items of the model's ModuleLists): at most this many pipeline stages."""
    param_modules: int
    """Modules owning parameters directly: ZeRO-3 gathers each once per forward and per backward."""
    ops_per_micro_batch: int = 0
    """Operations (kernels) one micro-batch's forward, loss and backward dispatch; their number
    does not depend on the micro-batch size."""
    ops_per_micro_batch_checkpointed: int = 0
    memory_bytes_per_sample: int = 0
    """Bytes the memory-bound kernels (norms, activations, softmax, residual adds, casts, the loss;
    not matmuls or attention) read and write in one sample's forward, loss and backward, with
    16-bit activations (:mod:`orch.plans.step_time.memory_traffic`)."""
    memory_bytes_sharded_per_sample: int = 0
    """The part of ``memory_bytes_per_sample`` that tensor parallelism divides by tp (the kernels
    between a column- and a row-parallel layer); the rest runs whole on every rank."""
    memory_bytes_per_sample_checkpointed: int = 0
    """``memory_bytes_per_sample`` with activation checkpointing (the recomputed forward included)."""
    memory_bytes_sharded_per_sample_checkpointed: int = 0
    memory_bytes_per_sample_compiled: int = 0
    """``memory_bytes_per_sample`` with the repeated layers compiled (``plan.compile``): their
    memory-bound kernels fused as inductor fuses them (:mod:`orch.plans.step_time.memory_traffic`);
    0: not counted (priced as eager)."""
    memory_bytes_per_sample_checkpointed_compiled: int = 0
    ops_fused_away_per_micro_batch: int = 0
    """Memory-bound kernels compiled layers run inside another one: fewer launches."""
    ops_fused_away_per_micro_batch_checkpointed: int = 0
    flops_outside_layers_per_sample: int = 0
    """The part of the FLOPs outside the repeated layers (the head and the loss, never recomputed):
    one pipeline stage runs it, not a share of it on every stage."""
    memory_bytes_first_stage_per_sample: int = 0
    """The memory-bound bytes outside the repeated layers before the first and after the last
    (the embedding's lookup and its backward): the first pipeline stage's, whole on every tp rank."""
    memory_bytes_last_stage_per_sample: int = 0
    """Those between (the head, the loss and their backward): the last pipeline stage's."""
    attention_kv_per_sample: int = 0
    """Elements of the keys and values one sample's forward gives ``scaled_dot_product_attention``,
    over every call: what context parallelism gathers per sample (tp = 1)."""
    attention_calls: int = 0
    """``scaled_dot_product_attention`` calls in one forward."""
    attention_forward_flops_per_sample: int = 0
    """FLOPs of those calls in one sample's forward, as the FLOP counter counts them (4 x heads x
    query length x key length x head width a call, a causal mask's skipped half included; inside
    ``flops_per_sample`` with its backward, twice as many, and a recomputed forward's)."""
    attention_shape: tuple[int, ...] = ()
    """(heads, query length, key length, head width, causal: 1 or 0) of the first call: what the
    calibration times attention at (() without attention)."""
    gemms: dict[int, tuple[tuple[Gemm, int], ...]] = dataclasses.field(default_factory=dict)
    """By tensor-parallel degree: the GEMMs one rank runs in one sample's forward, loss and backward
    (shape at micro-batch 1, and how many times), for :func:`matmul_efficiency`."""
    tp_splits_every_matmul: bool = False
    """Whether tensor parallelism splits every matmul, whatever the recorded shards say: set only
    to price a run whose software did (Megatron-LM's vocabulary-parallel output layer); the
    orchestrator's engines leave a layer outside the model's tensor-parallel plan whole (and split
    the output head where ``plan.loss_parallel`` does: :attr:`split_head`)."""
    split_head: ModelCost | None = None
    """The same counts with the output head split over the tensor-parallel ranks as well, for the
    plans that split it (:func:`orch.plans.parallel.vocab_parallel.splits_head`); None for a model
    without such a head."""

    def attention_flops_of(self, plan: ResolvedPlan) -> float:
        """The part of :meth:`flops_per_sample_of` that attention runs: its forward, its backward
        (twice the forward's) and, for the blocks full recomputation re-runs, the forward again
        (a selective policy keeps attention's outputs)."""
        forward = self.attention_forward_flops_per_sample
        recomputed = plan.recomputed_share(self.n_layers) if plan.activation_checkpointing == Recompute.full else 0.0
        return forward * (3 + recomputed)

    def flops_per_sample_of(self, plan: ResolvedPlan) -> float:
        """One sample's training FLOPs under ``plan``'s recomputation: none's, plus full's recomputed
        forward for the share of the blocks it recomputes (:meth:`ResolvedPlan.recomputed_share`).
        Selective recomputation adds none: it keeps every op the FLOP counter counts."""
        if plan.activation_checkpointing != Recompute.full:
            return self.flops_per_sample
        return self.flops_per_sample + plan.recomputed_share(self.n_layers) * (
            self.flops_per_sample_checkpointed - self.flops_per_sample)

@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part, and the rates that follow."""

    compute_s: float
    memory_s: float
    """Memory-bound kernels between the matmuls, at the device's sustained memory bandwidth."""
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    offload_s: float
    optimizer_s: float
    tokens_per_s: float
    tflops_per_device: float
    """Counted FLOPs (recomputation included: the work the devices do) per second and device."""
    model_tflops_per_device: float = 0.0
    """The model's FLOPs without recomputation per second and device: what MFU divides by the peak."""
    zero3_hooks_s: float = 0.0
    """Host time of DeepSpeed ZeRO-3's per-module fetch and release hooks (:data:`DECLARED_ZERO3_MODULE_S`)."""
    cp_comm_s: float = 0.0
    """Context parallelism's gathers of keys and values (and the reduce-scatters of their gradients)."""
    dp_gather_s: float = 0.0
    """ZeRO-1/2's all-gather of the updated parameters: data-parallel traffic like ``dp_comm_s``, but
    inside the optimizer step (DeepSpeed's ``step()`` ends with it), where the step is timed."""

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.memory_s + self.bubble_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s
                + self.offload_s + self.optimizer_s + self.zero3_hooks_s + self.cp_comm_s + self.dp_gather_s)

    def as_dict(self) -> dict[str, float]:
        return {"step_time_s": self.total_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "model_tflops_per_device": self.model_tflops_per_device,
                "parts_s": {"compute": self.compute_s, "memory": self.memory_s, "bubble": self.bubble_s,
                            "tp": self.tp_comm_s, "dp": self.dp_comm_s, "pp": self.pp_comm_s, "offload": self.offload_s,
                            "optimizer": self.optimizer_s, "zero3_hooks": self.zero3_hooks_s, "cp": self.cp_comm_s,
                            "dp_gather": self.dp_gather_s}}


@dataclass(frozen=True)
class Links:
    """Which link each kind of group crosses ('intra' or 'inter'), for the worst group of its kind."""

    tp: str
    pp: str
    dp: str
    cp: str = "intra"


def group_links(world_size: int, devices_per_node: int, tp: int, pp: int, cp: int = 1) -> Links:
    """Links of the tp, cp, pp and dp groups under the launch layout
    ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``.

    Nodes hold consecutive ranks. A group crosses nodes when two of its members are on different
    nodes; every group of a kind has the same shape, so the first one decides. Closed form (no
    per-rank loop): a 1024-rank layout is classified in microseconds.
    """
    dp = world_size // (tp * pp * cp)

    def crosses(stride: int, size: int) -> str:
        # members are 0, stride, 2*stride, ... (size of them): same node iff the last is on node 0.
        return "inter" if size > 1 and (size - 1) * stride >= devices_per_node else "intra"

    return Links(tp=crosses(group_stride("tp", tp, pp, cp), tp), pp=crosses(group_stride("pp", tp, pp, cp), pp),
                 dp=crosses(group_stride("dp", tp, pp, cp), dp), cp=crosses(group_stride("cp", tp, pp, cp), cp))


def _bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def _allreduce_s(nbytes: float, n: int, gbps: float, latency_s: float, calls: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` in total over ``n`` ranks, in ``calls`` collectives."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / _bytes_per_s(gbps) + calls * 2 * (n - 1) * latency_s


def _half_ring_s(nbytes: float, n: int, gbps: float, latency_s: float, calls: int = 1) -> float:
    """A reduce-scatter or an all-gather: half the traffic and steps of an all-reduce."""
    return _allreduce_s(nbytes, n, gbps, latency_s, calls) / 2


def _optimizer_bytes_per_param(optim: OptimSpec, precision: Precision) -> int:
    """Bytes the optimizer step reads and writes per parameter (it is bound by memory bandwidth).

    Adam: read and write the fp32 weight and both moments (3 x 8), read the fp32 gradient (4).
    SGD: the weight, the gradient and the momentum buffer if any. Gradient clipping reads the
    gradients once more for their norm. In mixed precision DeepSpeed's optimizers also copy the
    16-bit gradient into its fp32 one (read 2, write 4) and the updated fp32 weight into the
    16-bit one the model uses (read 4, write 2), each a kernel of its own.
    """
    clip = 4 if optim.grad_clip > 0 else 0
    low = precision.element_bytes
    casts = (low + 4) * 2 if precision != Precision.fp32 else 0
    return _update_bytes_per_param(optim) + clip + casts


def _update_bytes_per_param(optim: OptimSpec) -> int:
    """Bytes the update kernel alone reads and writes per fp32 parameter: Adam's 28 (weight and
    both moments read and written, the gradient read), SGD's 12, or 20 with momentum."""
    return (8 + 4 + (8 if optim.momentum else 0)) if optim.name == OptimizerName.sgd else 24 + 4


def host_optimizer_s(part: float, optim: OptimSpec, precision: Precision, speeds: Speeds,
                     devices_per_node: int) -> float:
    """Seconds of an offloaded optimizer step over ``part`` parameters on the host.

    Two bounds, whichever is slower: the threads of the worker (its rate, measured or declared,
    with the update's bytes against Adam's for another optimizer), and the node's memory
    bandwidth shared by every local worker stepping at once (the casts and the clipping norm
    included). A GPU worker reserving one CPU steps a billion Adam parameters on one thread.
    """
    shared_s = part * _optimizer_bytes_per_param(optim, precision) / (speeds.host_memory_gb_per_s * 1e9
                                                                        / devices_per_node)
    if not speeds.host_optimizer_params_per_s:
        return shared_s
    # The rate is Adam's in fp32 (the calibration's probe): another optimizer by its update's bytes.
    adam = _update_bytes_per_param(OptimSpec(name=OptimizerName.adamw))
    threads_s = part * _update_bytes_per_param(optim) / adam / speeds.host_optimizer_params_per_s
    return max(shared_s, threads_s)


def _members_per_node(stride: int, size: int, devices_per_node: int) -> int:
    """Ranks of one group (members ``0, stride, 2 * stride, ...``) that share a node."""
    return max(1, min(size, devices_per_node // stride)) if stride <= devices_per_node else 1


def stage_share(n_layers: int, pp: int) -> float:
    """The share of the model's repeated layers the busiest pipeline stage runs: ``1 / pp`` when
    they split evenly, ``ceil(n_layers / pp) / n_layers`` when they do not (a model without
    repeated layers is taken as evenly split)."""
    if pp <= 1:
        return 1.0
    if n_layers < pp:
        return 1 / pp
    return math.ceil(n_layers / pp) / n_layers


def _gemm_flops(gemms: tuple[tuple[Gemm, int], ...]) -> int:
    """FLOPs of one sample's GEMMs (at micro-batch 1)."""
    return sum(count * 2 * math.prod(gemm.at(1)) for gemm, count in gemms)


FP8_WIDTH_MULTIPLE = 16
"""Widths a linear layer must be a multiple of to multiply in FP8 (torch._scaled_mm's alignment;
the fsdp2 engine converts only such layers)."""
FP8_CAST_BYTES = {False: 5, True: 3}
"""Bytes moved per element to cast one operand of an FP8 matmul from bf16, eager (False): its
absolute maximum (a 2-byte read) for the scale, then the scaled cast (a 2-byte read and a 1-byte
write); compiled (True), the two fuse into one read and the write."""


@dataclass(frozen=True, kw_only=True)
class Fp8Matmuls:
    """What ``plan.precision=fp8`` changes in one rank's matmuls of one sample."""

    flops: float
    """FLOPs of the matmuls that run in FP8: the repeated layers' linear layers of FP8 widths."""
    cast_elements: float
    """Operand elements those matmuls cast to FP8 (both operands of each: forward, input
    gradient and weight gradient)."""


def fp8_matmuls(model: ModelCost, tp: int, micro_batch: float) -> Fp8Matmuls:
    """The FP8 matmuls of one micro-batch of ``micro_batch`` samples on one rank at ``tp``: the 2-D
    GEMMs recorded (linear layers; attention's batched products stay in bf16) whose two widths
    other than the tokens are multiples of :data:`FP8_WIDTH_MULTIPLE`, less the FLOPs outside the
    repeated layers (the output head, which the engine leaves in bf16, and the loss), whose share
    of the casts goes with them. A weight operand is cast once per micro-batch, an activation once
    per sample."""
    gemms = model.gemms.get(tp) or model.gemms.get(1, ())
    flops = cast = 0.0
    for gemm, count in gemms:
        widths = [size for dim, size in (("m", gemm.m), ("n", gemm.n), ("k", gemm.k)) if dim != gemm.grows]
        if gemm.batch != 1 or any(size % FP8_WIDTH_MULTIPLE for size in widths):
            continue
        _, m, n, k = gemm.at(micro_batch)
        flops += count * 2 * m * n * k
        cast += count * (m * k + k * n)
    outside = model.flops_outside_layers_per_sample * micro_batch
    kept = max(flops - outside, 0.0)
    return Fp8Matmuls(flops=kept, cast_elements=cast * (kept / flops if flops else 0.0))


def tp_whole_flops(model: ModelCost, tp: int) -> float:
    """FLOPs per sample that each of ``tp`` ranks runs beyond its 1/tp share of the model's: the
    matmuls of the layers tensor parallelism leaves whole, read off the GEMMs recorded on the tp
    shard against the unsharded model's (0 when either was not recorded)."""
    if tp <= 1 or model.tp_splits_every_matmul or 1 not in model.gemms or tp not in model.gemms:
        return 0.0
    return max(_gemm_flops(model.gemms[tp]) - _gemm_flops(model.gemms[1]) / tp, 0.0)


def _busiest_stage(model: ModelCost, flops: int, whole: int, sharded: int, *, stage: float, tp: int, pp: int,
                   flops_per_s: float, bytes_per_s: float, core_share: float = 1.0) -> tuple[float, float]:
    """(FLOPs, memory-bound bytes) per sample of one tensor-parallel rank of the stage that paces
    the 1F1B schedule.

    Each stage runs its share ``stage`` of the repeated layers; the work outside them is not
    shared: the first stage runs the embedding, the last the head and the loss (the larger, in
    time, paces the schedule). Without a pipeline the one stage runs all of it. FLOPs are divided
    by tp, less the matmuls tensor parallelism leaves whole (:func:`tp_whole_flops`), which run
    whole on every rank: outside the layers first (the head, on the last stage), then in them.
    The bytes outside the layers run whole on every rank. Workers that
    time-share a node's cores (``core_share`` < 1) run the end stage's surplus on a whole core
    while the others wait, as in the bubble (:func:`bubble_micro_batches`): it costs
    ``core_share`` of its time over the even split.
    """
    unsplit = tp_whole_flops(model, tp)
    if pp <= 1:
        return flops / tp + unsplit, whole - sharded + sharded / tp
    outside_flops = min(model.flops_outside_layers_per_sample, flops)
    unsplit_outside = min(unsplit, outside_flops * (1 - 1 / tp))
    first = model.memory_bytes_first_stage_per_sample
    last = model.memory_bytes_last_stage_per_sample
    inner_whole = max(whole - sharded - first - last, 0)
    ends = {"first": (0.0, first), "last": (outside_flops / tp + unsplit_outside, last)}
    end_flops, end_bytes = max(ends.values(), key=lambda fb: fb[0] / flops_per_s + fb[1] / bytes_per_s)
    busiest = (((flops - outside_flops) / tp + unsplit - unsplit_outside) * stage + end_flops,
               (inner_whole + sharded / tp) * stage + end_bytes)
    even = ((flops / tp + unsplit) * stage, (whole - sharded + sharded / tp) * stage)
    return tuple(e + core_share * max(b - e, 0.0) for b, e in zip(busiest, even, strict=True))


def bubble_micro_batches(pp: int, core_share: float) -> float:
    """Micro-batch times a step loses to the pipeline's fill and drain.

    In the fill, ``k`` of ``pp`` stages compute while the others wait (k = 1 .. pp-1), and the
    drain mirrors it. On devices of their own each waiting stage idles its device, which adds up
    to ``pp - 1`` micro-batch times. Workers sharing a node's cores (each gets ``core_share`` of a
    core when all compute) are work-conserving instead: the waiting stages' cores go to the busy
    ones, and only cores beyond the busy stages' workers idle, a fraction ``core_share - k / pp``
    of the node's cores (none when it is below 0), for one micro-batch time at full speed
    (``core_share`` of one at the shared rate). With ``core_share`` 1 this is ``pp - 1``.
    """
    return 2 * sum(max(0.0, core_share - k / pp) for k in range(1, pp))


def schedule_share(plan: ResolvedPlan, model_layers: int = 0) -> float:
    """The plan's pipeline bubble as a share of 1F1B's (1 for gpipe and 1f1b); ``model_layers``:
    the model's repeated blocks, of which ``plan.recompute_every_n_layers`` picks the recomputed."""
    from orch.plans.parallel.schedules import BackwardSplit
    from orch.plans.parallel.schedules import bubble_micro_batches as schedule_bubble

    if plan.pp <= 1:
        return 1.0
    full = plan.activation_checkpointing == Recompute.full
    split = BackwardSplit.of_matmuls(plan.recomputed_share(model_layers) if full else 0.0)
    return schedule_bubble(plan.pp_schedule, plan.pp, plan.pp_virtual_stages, split) / (
        (plan.pp - 1) * (split.forward + split.inputs + split.weights))


def predict_step(plan: ResolvedPlan, model: ModelCost, speeds: Speeds, *, devices_per_node: int,
                 optim: OptimSpec) -> StepTime:
    """Seconds of one optimizer step of ``plan`` on the slowest device (see the module docstring)."""
    dp, tp, pp, m, mb = plan.dp, plan.tp, plan.pp, plan.grad_accum_steps, plan.micro_batch_size
    cp = plan.cp
    links = group_links(plan.world_size, devices_per_node, tp, pp, cp)
    lat = {"intra": speeds.intra_latency_s, "inter": speeds.inter_latency_s}
    act_bytes = plan.precision.element_bytes
    engine = engine_settings(plan, optim)

    # Selective recomputation keeps every op the FLOPs are in (the matmuls and attention) and runs
    # the rest of the forward again: the FLOPs of none, the kernels and bytes of full.
    # DeepSpeed splits whole layers between stages, and the 1F1B schedule runs at the pace of the
    # stage with the most: ceil(layers / pp) of them, not layers / pp.
    stage = stage_share(model.n_layers, pp)
    # The share of the busiest rank's blocks that recompute (plan.recompute_every_n_layers): every
    # term below moves from none's value toward the policy's in proportion, as its blocks do.
    recomputed = plan.recomputed_share(model.n_layers)

    def mixed(none: float, policy: float) -> float:
        return none + recomputed * (policy - none)
    flops = model.flops_per_sample_of(plan)
    # Attention runs at its own rate (``Speeds.attention_share`` of the matmuls'): its FLOPs take as
    # long as 1 / share times as many matmul FLOPs (the counted FLOPs, for the rates, stay as counted).
    timed_flops = flops + model.attention_flops_of(plan) * (1 / speeds.attention_share - 1)
    ops = mixed(model.ops_per_micro_batch, model.ops_per_micro_batch_checkpointed)
    if plan.compile:
        ops -= mixed(model.ops_fused_away_per_micro_batch, model.ops_fused_away_per_micro_batch_checkpointed)
    # GPUs: each GEMM at its shape (waves of tiles over the SMs, memory-bound when thin), the
    # recomputed forward at the forward's mix; CPUs: the calibrated rate for the matmul height.
    # Context parallelism: each rank runs 1/cp of every sample's tokens, and as much of its
    # attention (the head-tail chunks balance the causal mask's work); ``rank_samples`` is the share of a
    # micro-batch's work one rank does.
    rank_samples = mb / cp
    # Async TP runs each tensor-parallel matmul in tp chunks of its rows, one per rank's slice of the
    # sequence: at the rate and wave efficiency of a GEMM 1/tp as tall (every GEMM of the pass is
    # priced so; the head and attention, which it leaves whole, are a small share of a deep model's).
    chunks = tp if plan.async_tp and tp > 1 else 1
    rate = speeds.tflops_at(max(mb * model.seq_len // (cp * chunks), 1)) * 1e12
    efficiency = matmul_efficiency(model.gemms.get(tp, ()), rank_samples / chunks, speeds, flops_per_s=rate,
                                   element_bytes=act_bytes)
    whole = round(mixed(model.memory_bytes_per_sample, model.memory_bytes_per_sample_checkpointed))
    sharded = round(mixed(model.memory_bytes_sharded_per_sample, model.memory_bytes_sharded_per_sample_checkpointed))
    compiled = round(mixed(model.memory_bytes_per_sample_compiled,
                           model.memory_bytes_per_sample_checkpointed_compiled))
    if plan.compile and compiled and whole:
        # Fusion removes the same share of the bytes from the sharded kernels as from the whole.
        whole, sharded = compiled, round(sharded * compiled / whole)
    if plan.sequence_parallel and tp > 1:
        # Sequence parallelism runs the layers' norms and residual adds on 1/tp of the sequence as
        # well: all their bytes are divided by tp, the embedding's, head's and loss's stay whole. Its
        # reduce-scatters and all-gathers move the all-reduces' bytes in as many ring steps, so the
        # tensor-parallel traffic below is unchanged.
        outside = model.memory_bytes_first_stage_per_sample + model.memory_bytes_last_stage_per_sample
        sharded = max(sharded, whole - outside)
    # Counted with 16-bit activations: fp32 plans move twice the bytes.
    bytes_per_s = speeds.sustained_memory_gb_per_s * 1e9 * 2 / act_bytes
    stage_flops, stage_bytes = _busiest_stage(model, timed_flops, whole, sharded, stage=stage, tp=tp, pp=pp,
                                              flops_per_s=rate * efficiency, bytes_per_s=bytes_per_s,
                                              core_share=speeds.core_share)
    per_micro_s = stage_flops * rank_samples / (rate * efficiency) + ops * stage * speeds.op_overhead_s
    memory_per_micro_s = stage_bytes * rank_samples / bytes_per_s
    if plan.precision == Precision.fp8 and speeds.fp8_speedup > 0:
        # FP8 matmuls run fp8_speedup times as fast as bf16's (again in a fully recomputed forward:
        # a third of a layer's matmul work; selective recomputation keeps their outputs), after
        # casting both operands (memory-bound).
        fp8 = fp8_matmuls(model, tp, rank_samples)
        passes = stage * (1 + (recomputed / 3 if plan.activation_checkpointing == Recompute.full else 0.0))
        per_micro_s -= fp8.flops * passes / (rate * efficiency) * (1 - 1 / speeds.fp8_speedup)
        memory_per_micro_s += (fp8.cast_elements * passes * FP8_CAST_BYTES[plan.compile]
                               / (speeds.sustained_memory_gb_per_s * 1e9))

    tp_per_micro_s = 0.0
    if tp > 1:
        # Per micro-batch, this stage's share of the layers: forward all-reduces (twice with
        # recomputation) and backward ones.
        forward_passes = 1 + recomputed

        def tp_collective_s(nbytes: float, calls: int) -> float:
            # Sequence parallelism splits each all-reduce into a reduce-scatter and an all-gather
            # of the same bytes, each at its own rate.
            if not plan.sequence_parallel:
                return _allreduce_s(nbytes, tp, speeds.bus_gbps(links.tp), lat[links.tp], calls=calls)
            return sum(_half_ring_s(nbytes, tp, speeds.bus_gbps(links.tp, collective=kind), lat[links.tp], calls=calls)
                       for kind in ("reduce_scatter", "all_gather"))

        fwd = tp_collective_s(model.row_parallel_out_per_sample * rank_samples * act_bytes * stage,
                              math.ceil(model.row_parallel_layers * stage))
        bwd = tp_collective_s(model.column_parallel_in_per_sample * rank_samples * act_bytes * stage,
                              math.ceil(model.column_parallel_layers * stage))
        tp_per_micro_s = forward_passes * fwd + bwd
        if chunks > 1:
            # Async TP: while one chunk's matmul runs, the next chunk of its all-gather arrives (or
            # the previous chunk's output is reduce-scattered). The last reduce-scatter chunk, 1/tp
            # of the traffic, is left exposed, and the rest wherever it outlasts the matmuls.
            tp_per_micro_s = tp_per_micro_s / tp + max(0.0, tp_per_micro_s * (tp - 1) / tp - per_micro_s)

    pp_per_micro_s = 0.0
    if pp > 1:
        # DeepSpeed's pipeline engine sends each boundary activation forward and its gradient back
        # as blocking point-to-point transfers (a broadcast in a 2-rank group): nothing overlaps
        # them with compute. With tp > 1 it splits both over the tensor-parallel ranks
        # (``pipe_partitioned`` / ``grad_partitioned``, on by default when the topology has a
        # ``model`` axis): each rank sends 1/tp and the receiving stage all-gathers the whole.
        # A context-parallel rank sends its part of the sequence: 1/cp of the boundary activation.
        p2p_bytes = model.boundary_per_sample * rank_samples * act_bytes
        gather_s = (_half_ring_s(p2p_bytes, tp, speeds.bus_gbps(links.tp, collective="all_gather"), lat[links.tp])
                    if tp > 1 else 0.0)
        pp_per_micro_s = 2 * (p2p_bytes / tp / _bytes_per_s(speeds.bus_gbps(links.pp)) + lat[links.pp] + gather_s)

    cp_per_micro_s = 0.0
    if cp > 1:
        # Every attention call gathers the whole sequence's keys and values (this rank's heads: 1/tp
        # of them), in each forward (again in a recomputed one: the gather is not among the ops a
        # selective policy keeps), and reduce-scatters their gradients in backward. Not overlapped:
        # attention waits for its keys. A pipeline stage runs its share of the attention calls.
        kv_bytes = model.attention_kv_per_sample * mb * act_bytes / tp * stage
        calls = max(math.ceil(model.attention_calls * stage), 1)
        gather_bw = speeds.bus_gbps(links.cp, collective="all_gather")
        scatter_bw = speeds.bus_gbps(links.cp, collective="reduce_scatter")
        cp_per_micro_s = ((1 + recomputed) * _half_ring_s(kv_bytes, cp, gather_bw, lat[links.cp], calls=calls)
                          + _half_ring_s(kv_bytes, cp, scatter_bw, lat[links.cp], calls=calls))

    compute_s = m * per_micro_s
    memory_s = m * memory_per_micro_s
    tp_comm_s = m * tp_per_micro_s
    # An interleaved schedule sends each micro-batch across every one of its pp * v stage boundaries.
    pp_comm_s = m * pp_per_micro_s * (plan.pp_virtual_stages if pp > 1 else 1)
    # 1F1B: in the fill and the drain a stage waits for whole micro-batch times of the stages
    # before and after it, each its compute, memory-bound kernels, all-reduces, transfers and
    # key/value gathers. The other schedules shorten the fill and drain by their share of 1F1B's
    # (p - 1) micro-batches (orch.plans.parallel.schedules: 1/v interleaved; the weights' backward
    # moved into it for the zero-bubble ones, F = B = W for matmuls, full recomputation adding a
    # forward to B).
    bubble_s = bubble_micro_batches(pp, speeds.core_share) * schedule_share(plan, model.n_layers) * (
        per_micro_s + memory_per_micro_s + tp_per_micro_s + pp_per_micro_s + cp_per_micro_s)

    # Parameters of this device: its tensor-parallel shard of its stage's layers.
    params = model.tp_param_count.get(tp, model.param_count / tp) / pp
    grad_bytes = params * plan.precision.element_bytes
    # A data-parallel group's members are tp * pp ranks apart: with fewer, several share a node
    # and its network adapters.
    dp_members = _members_per_node(group_stride("dp", tp, pp), dp, devices_per_node)
    dp_bw = speeds.bus_gbps(links.dp, dp_members)
    gather_bw = speeds.bus_gbps(links.dp, dp_members, collective="all_gather")
    scatter_bw = speeds.bus_gbps(links.dp, dp_members, collective="reduce_scatter")
    dp_lat = lat[links.dp]
    # ZeRO-3 fetches a stage's parameter modules in forward, backward and the recomputed forward.
    fetches = 2 + recomputed
    stage_modules = max(math.ceil(model.param_modules / pp), 1)
    dp_comm_s = dp_gather_s = 0.0
    if dp > 1:
        if engine.zero_stage in (ZeroStage.optimizer_states, ZeroStage.gradients):
            dp_gather_s = _half_ring_s(grad_bytes, dp, gather_bw, dp_lat)
        if engine.zero_stage == ZeroStage.none:
            dp_comm_s = _allreduce_s(grad_bytes, dp, dp_bw, dp_lat)
        elif engine.zero_stage == ZeroStage.optimizer_states:
            dp_comm_s = _allreduce_s(grad_bytes, dp, dp_bw, dp_lat)
        elif engine.zero_stage == ZeroStage.gradients:
            dp_comm_s = m * _allreduce_s(grad_bytes, dp, dp_bw, dp_lat)
        else:
            dp_comm_s = m * (fetches * _half_ring_s(grad_bytes, dp, gather_bw, dp_lat, calls=stage_modules)
                             + _half_ring_s(grad_bytes, dp, scatter_bw, dp_lat))

    # The optimizer updates this rank's partition: all of its parameters below ZeRO-1. FSDP2 shards
    # over the context-parallel ranks as well (they hold the same parameters).
    shards = dp * cp
    part = params / shards if engine.zero_stage >= ZeroStage.optimizer_states else params
    offload_s = 0.0
    if engine.offload_optimizer != Offload.none:
        link = _bytes_per_s(speeds.host_link_gbps)
        # Gradients down, updated weights up; the node's CPU runs every local rank's optimizer at once.
        offload_s = 2 * part * plan.precision.element_bytes / link
        optimizer_s = host_optimizer_s(part, optim, plan.precision, speeds, devices_per_node)
    else:
        optimizer_s = (part * _optimizer_bytes_per_param(optim, plan.precision)
                       / (speeds.sustained_memory_gb_per_s * 1e9))
    if engine.offload_param != Offload.none:
        offload_s += m * fetches * (params / shards) * plan.precision.element_bytes / _bytes_per_s(
            speeds.host_link_gbps)
    zero3_hooks_s = 0.0
    if engine.module_hooks:
        zero3_hooks_s = m * fetches * stage_modules * DECLARED_ZERO3_MODULE_S[plan.accelerator.value]

    parts = StepTime(compute_s=compute_s, memory_s=memory_s, bubble_s=bubble_s, tp_comm_s=tp_comm_s,
                     dp_comm_s=dp_comm_s, pp_comm_s=pp_comm_s, offload_s=offload_s, optimizer_s=optimizer_s,
                     zero3_hooks_s=zero3_hooks_s, cp_comm_s=m * cp_per_micro_s, dp_gather_s=dp_gather_s,
                     tokens_per_s=0.0, tflops_per_device=0.0)
    total = parts.total_s
    samples = plan.global_batch_size
    return dataclasses.replace(parts, tokens_per_s=samples * model.seq_len / total,
                               tflops_per_device=flops * samples / total / plan.world_size / 1e12,
                               model_tflops_per_device=model.flops_per_sample * samples / total / plan.world_size
                               / 1e12)
