"""Measure a live cluster's speeds for the tuner's cost model: short probes on the Ray workers.

One actor per worker slot, placed like a training run's workers (a placement group, PACK), so
the probes see what training will: the same devices, the same number of workers sharing a node's
memory bandwidth, and the same links. GPU workers measure at once, because that is how they run;
on a CPU node one worker measures and the rates are scaled to the node's cores per worker:

- dense matmul TFLOP/s in the training precision, at the matmul heights the plans would use
  (micro-batch x sequence rows, the model's repeated-layer width), since small matmuls run far
  below peak, on CPUs most of all;
- memory bandwidth (a large copy), which bounds the optimizer step; on GPUs also host memory and
  the host link (pinned host-to-device copies);
- all-reduce latency (a one-element all-reduce, back to back and between stretches of compute as
  tensor-parallel layers issue it; the larger counts) and bus bandwidth (a 16 MB one) inside a
  node and, with several nodes, across them, through ``torch.distributed`` as training uses it;
  and the bus bandwidth of a 16 MB all-gather and reduce-scatter over the same groups, as a share
  of the all-reduce's (gloo runs them far slower; FSDP2 and ZeRO move parameters and gradients
  with them).

The result is cached per cluster (the workers' hostnames, shape and the probe's parameters) in a
JSON file, so a second ``orch tune`` on the same cluster starts at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import ray

from orch.launchers.rendezvous import AGENT_STORE_ENV, RendezvousHost
from orch.launchers.worker_group import NoPlacementError, WorkerGroupSpec, place_actors
from orch.plans.errors import OrchError
from orch.plans.spec import Precision
from orch.plans.step_time.cost_model import Speeds
from orch.plans.step_time.profile import speeds_problems
from orch.plans.storage.locations import write_whole

_BANDWIDTH_ELEMENTS = 4 * 1024 * 1024  # 16 MB of fp32: large enough that latency is a few percent
# Part of the cache key: a cache written by older probes is measured again, not misread.
_PROBES_VERSION = 9


class CalibrationWorker:
    """One worker slot's probes (a Ray actor)."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def address(self) -> tuple[str, int]:
        """Where this actor, as rank 0, hosts the rendezvous: its node's IP and a port bound there."""
        self.rendezvous = RendezvousHost(ray.util.get_node_ip_address())
        return self.rendezvous.address

    def compute(self, rows: list[int], k: int, n: int, precision: str, seconds: float = 0.3,
                attention: tuple[int, ...] = ()) -> dict:
        """Matmul TFLOP/s per height, memory GB/s (read + write of a 64 MB copy) and, given the
        model's attention shape, attention's rate as a share of the matmuls' (:func:`_attention_share`);
        on a GPU also the host's memory, its link to the device and the rate of an offloaded optimizer step."""
        import torch

        from orch.launchers.cpu_bf16 import bf16_in_fp32

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dtype = Precision(precision).dtype
        before = node_cpu_times()
        b = torch.randn(k, n, dtype=dtype, device=device)
        tflops = []
        with bf16_in_fp32(precision, device):  # as the training steps compute them
            for m in rows:
                a = torch.randn(m, k, dtype=dtype, device=device)
                a @ b  # warm-up
                tflops.append(2 * m * k * n / _best_time(lambda a=a: a @ b, device, seconds) / 1e12)
            share = _attention_share(attention, rows, tflops, dtype, device, seconds) if attention else None
        facts = {"tflops": tflops, "device_gb_per_s": _copy_gb_per_s(device, seconds),
                 "op_overhead_s": _op_overhead_s(device, seconds),
                 "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                 "threads": torch.get_num_threads()}
        if share is not None:
            facts["attention_share"] = share
        if device.type == "cuda":
            facts["host_gb_per_s"] = _copy_gb_per_s(torch.device("cpu"), seconds)
            facts["host_link_gbps"] = _host_link_gbps(device, seconds)
            facts["host_optimizer_params_per_s"] = _host_adam_params_per_s(seconds)
        after = node_cpu_times()
        if before is not None and after is not None:
            facts["load"] = probe_load(before, after)
        return facts

    def communication(self, rank: int, world_size: int, master: tuple[str, int], node_groups: list[list[int]],
                      env: dict[str, str]) -> dict:
        """Collective latency and bus bandwidths within this node's group and across node leaders."""
        local_ranks = next(group for group in node_groups if rank in group)
        leaders = [group[0] for group in node_groups]
        os.environ.update(env)
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_ranks.index(rank)),
                           "LOCAL_SIZE": str(len(local_ranks)), "LOCAL_WORLD_SIZE": str(len(local_ranks)),
                           **AGENT_STORE_ENV})
        import torch
        import torch.distributed as dist

        backend = "gloo" if env.get("DS_ACCELERATOR") == "cpu" else "nccl"
        # NCCL reduces device tensors only: the probes' tensors live on this worker's GPU.
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # torch's process group, as every engine's collectives are (DeepSpeed's training all-reduce
        # is torch.distributed.all_reduce on this group).
        dist.init_process_group(backend=backend)
        try:
            # Every rank creates every group (collective), then measures the ones it belongs to.
            groups = {tuple(members): dist.new_group(members) for members in node_groups if len(members) > 1}
            leader_group = dist.new_group(leaders) if len(leaders) > 1 else None
            out = {}
            if tuple(local_ranks) in groups:
                out["intra"] = _collective_probe(groups[tuple(local_ranks)], len(local_ranks), device)
            if leader_group is not None and rank in leaders:
                out["inter"] = _collective_probe(leader_group, len(leaders), device)
            dist.barrier()
            return out
        finally:
            dist.destroy_process_group()


def node_cpu_times() -> tuple[float, float, float] | None:
    """(CPU seconds the node's processors have been busy, CPU seconds this process has used, a
    wall-clock reading), or None where the kernel does not say (no ``/proc/stat``)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    # user, nice, system, idle, iowait, irq, softirq, steal: busy is all but idle and iowait (steal,
    # time the hypervisor gave to others, is as lost to the probes as another process's).
    busy = sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def probe_load(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict:
    """The node's busy cores and this process's own over a probe, from two :func:`node_cpu_times`."""
    wall = max(after[2] - before[2], 1e-9)
    return {"busy_cores": (after[0] - before[0]) / wall, "own_cores": (after[1] - before[1]) / wall,
            "cpus": os.cpu_count() or 1}


BUSY_SHARE = 0.25
"""Other work on more than this share of a node's cores (and on more than one core) while its
probes ran makes a calibration *disturbed*: its rates are those of a shared host, not the node's."""


def disturbance(loads_by_node: dict[str, list[dict]]) -> str:
    """What other work ran on the nodes while their workers probed (``other processes kept 13.7 of
    HOST's 16 cores busy``), or "" when none worth saying.

    A node's workers probe at the same time, so the work that was not theirs is the node's busy
    cores over the probe less the cores they used themselves. On an H200 machine, probes run while
    compilers kept its 16 cores busy read host memory at 16 GB/s instead of about 195
    (bench/results/gpu_smoke-nvidia-h200.md): a disturbed host-side rate can be off tenfold.
    """
    said = []
    for host, loads in loads_by_node.items():
        if not loads:
            continue
        others = max(load["busy_cores"] for load in loads) - sum(load["own_cores"] for load in loads)
        cpus = loads[0]["cpus"]
        if others > max(1.0, BUSY_SHARE * cpus):
            said.append(f"other processes kept {others:.1f} of {host}'s {cpus} cores busy")
    return "; ".join(said)


def disturbed_note(disturbed: str) -> str:
    """What a calibration's note says of a :func:`disturbance`."""
    return (f"measured on a busy host ({disturbed} while the probes ran), so the host-side speeds may be far below "
            "the node's: measure again with `orch calibrate` when the node is otherwise idle")


def _best_time(call, device, seconds: float, windows: int = 3) -> float:
    """Seconds per call, from the fastest of a few timing windows: on a shared machine the
    fastest window is the one least disturbed by other work, i.e. what the hardware does."""
    best = float("inf")
    for _ in range(windows):
        runs, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds / windows or runs == 0:
            call()
            runs += 1
        _synchronize(device)
        best = min(best, (time.perf_counter() - started) / runs)
    return best


def _copy_gb_per_s(device, seconds: float) -> float:
    import torch

    a = torch.empty(16 * 1024 * 1024, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * a.numel() * 4 / _best_time(lambda: b.copy_(a), device, seconds) / 1e9


def _attention_share(shape: tuple[int, ...], rows: list[int], tflops: list[float], dtype, device,
                     seconds: float) -> float:
    """``scaled_dot_product_attention``'s FLOP rate, forward and backward, at the model's attention
    ``shape`` (heads, query length, key length, head width, causal), over the matmuls' rate at the
    same rows (the tallest of ``rows``: the most samples a plan's micro-batch holds). Its FLOPs are
    counted as torch's FLOP counter counts them (a causal mask's skipped half included), as the
    planner counts the model's (``ModelCost.attention_forward_flops_per_sample``), so the share
    prices those FLOPs as they run. The kernel is the one training reaches (flash on CPUs and GPUs)."""
    import torch
    import torch.nn.functional as F

    heads, q_len, k_len, width, causal = shape
    batch = max(1, rows[-1] // q_len)
    q = torch.randn(batch, heads, q_len, width, dtype=dtype, device=device, requires_grad=True)
    kv = [torch.randn(batch, heads, k_len, width, dtype=dtype, device=device, requires_grad=True) for _ in range(2)]
    grad = torch.randn(batch, heads, q_len, width, dtype=dtype, device=device)

    def step() -> None:
        torch.autograd.grad(F.scaled_dot_product_attention(q, *kv, is_causal=bool(causal)), [q, *kv], grad)

    step()  # warm-up
    flops = 3 * 4 * batch * heads * q_len * k_len * width
    rate = flops / _best_time(step, device, seconds) / 1e12
    return rate / tflops[-1]


def _host_adam_params_per_s(seconds: float, numel: int = 32 * 1024 * 1024) -> float:
    """Parameters per second an Adam step on the host updates with this worker's threads (the
    ones an offloaded optimizer gets): torch's fused CPU AdamW, which runs as fast as DeepSpeed's
    CPU Adam (599 and 584 M parameters/s on one core here), over 512 MB of fp32 state so that
    the host's memory, not its cache, serves it."""
    import torch

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.zeros(numel)
    try:
        optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    except RuntimeError:  # a torch without the fused CPU kernel: the one its optimizer would use
        optimizer = torch.optim.AdamW([param], lr=1e-4, foreach=True)
    optimizer.step()  # creates the moments
    return numel / _best_time(optimizer.step, torch.device("cpu"), seconds)


def _op_overhead_s(device, seconds: float) -> float:
    """Seconds per operation of a training step made of tiny ops (so their fixed cost is all
    there is): forward and backward of a small MLP, ops counted as the cost model counts them."""
    import torch

    from orch.plans.step_time.model_cost import OpCounter

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(4)])
    model.to(device)
    x = torch.randn(4, 16, device=device)

    def step() -> None:
        model(x).sum().backward()

    step()
    with OpCounter() as counter:
        step()
    return _best_time(step, device, seconds) / counter.ops


def _host_link_gbps(device, seconds: float) -> float:
    import torch

    host = torch.empty(16 * 1024 * 1024, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=device)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        dev.copy_(host, non_blocking=True)
        runs += 1
    torch.cuda.synchronize(device)
    return host.numel() * 4 * runs * 8 / (time.perf_counter() - started) / 1e9


def _synchronize(device) -> None:
    """Wait for the device's queued work: a collective on a GPU returns once it is enqueued."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _collective_probe(group, n: int, device) -> dict:
    import torch
    import torch.distributed as dist

    small = torch.zeros(1, device=device)
    large = torch.zeros(_BANDWIDTH_ELEMENTS, device=device)
    for _ in range(3):  # warm-up: connections, buffers
        dist.all_reduce(small, group=group)
    _synchronize(device)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        dist.all_reduce(small, group=group)
        _synchronize(device)
        times.append(time.perf_counter() - started)
    # The fastest of the calls is the least disturbed; a ring all-reduce takes 2(n-1) steps.
    latency = min(times) / (2 * (n - 1))
    dist.all_reduce(large, group=group)
    _synchronize(device)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dist.all_reduce(large, group=group)
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    bus_bytes = 2 * (n - 1) / n * large.numel() * 4
    gbps = bus_bytes * 8 / max(best - 2 * (n - 1) * latency, 1e-9) / 1e9
    return {"latency_s": max(_latency_between_compute(group, n, device), latency), "gbps": gbps,
            **{f"{kind}_share": _half_ring_gbps(kind, group, n, device, latency) / gbps
               for kind in ("all_gather", "reduce_scatter")}}


def _half_ring_gbps(kind: str, group, n: int, device, latency_s: float) -> float:
    """Bus bandwidth (Gbit/s) of a 16 MB all-gather or reduce-scatter, through the calls FSDP2 and
    ZeRO make (``all_gather_into_tensor``, ``reduce_scatter_tensor``). NCCL runs them at its
    all-reduce's bus rate; gloo at a quarter to a half of it, which would leave FSDP2's gathers
    and reductions priced two to four times too fast at the all-reduce's."""
    import torch
    import torch.distributed as dist

    whole = torch.zeros(_BANDWIDTH_ELEMENTS, device=device)
    shard = torch.zeros(_BANDWIDTH_ELEMENTS // n, device=device)

    def call() -> None:
        if kind == "all_gather":
            dist.all_gather_into_tensor(whole, shard, group=group)
        else:
            dist.reduce_scatter_tensor(shard, whole, group=group)

    call()
    _synchronize(device)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        call()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    bus_bytes = (n - 1) / n * whole.numel() * 4
    return bus_bytes * 8 / max(best - (n - 1) * latency_s, 1e-9) / 1e9


def _latency_between_compute(group, n: int, device, calls: int = 100, windows: int = 3) -> float:
    """Latency of one ring step of a small all-reduce issued between stretches of compute, as a
    tensor-parallel layer issues it. Back to back, the ranks arrive together and a call costs the
    wire alone; after compute each rank waits for the slowest one, whose compute the others'
    threads, the OS and a shared core delay by a varying amount. That wait is what training pays:
    the extra time per call of compute followed by an all-reduce over compute alone (the median
    of a few windows), spread over the 2(n-1) steps the cost model charges a call."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256, device=device)
    a @ a
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ a
    _synchronize(device)
    per_matmul = (time.perf_counter() - started) / 10
    # Every rank runs the same compute between calls (~2 ms, as a layer's matmuls on a small model).
    reps = torch.tensor([max(1, round(2e-3 / per_matmul))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
    reps = int(reps.item())
    small = torch.zeros(1, device=device)

    def compute() -> None:
        for _ in range(reps):
            a @ a

    extra = []
    for _ in range(windows):
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(calls):
            compute()
        _synchronize(device)
        alone = time.perf_counter() - started
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(calls):
            compute()
            dist.all_reduce(small, group=group)
        _synchronize(device)
        extra.append((time.perf_counter() - started - alone) / calls)
    return max(statistics.median(extra), 0.0) / (2 * (n - 1))


def cpu_share(facts: dict, workers_on_node: int) -> dict:
    """A lone worker's speeds scaled to its share of the node's cores when the node's workers
    together run more threads than it has cores (e.g. 4 one-thread workers on 2 cores: each
    gets half a core's time, so every rate halves and every fixed cost doubles)."""
    share = min(1.0, facts["cores"] / (workers_on_node * facts["threads"]))
    return {**facts, "share": share, "tflops": [t * share for t in facts["tflops"]],
            "device_gb_per_s": facts["device_gb_per_s"] * share, "op_overhead_s": facts["op_overhead_s"] / share}


class CalibrationError(OrchError):
    """The cluster could not be measured."""


def _cache_file(cache_dir: str, key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cache_dir)) / f"calibration-{digest}.json"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a calibration found: the speeds, and where each came from."""

    speeds: Speeds
    note: str
    """Measured now, or read from the cache (and which file)."""
    hosts: tuple[str, ...]
    """The workers' hostnames, in rank order."""
    nodes: int
    """Ray nodes the workers ran on (several may share a host)."""
    sources: dict[str, str]
    """For each speed, the probe that measured it, or why it stayed as declared."""
    disturbed: str = ""
    """What other work ran on the nodes while they were measured (:func:`disturbance`), or "";
    :func:`disturbed_note` says it."""


def calibrate(*, world_size: int, devices_per_node: int, cpus_per_worker: float, gpus_per_worker: float,
              env: dict[str, str], precision: str, rows: list[int], k: int, n: int, declared: Speeds,
              cache_dir: str, wait_s: float = 60.0, use_cache: bool = True,
              attention: tuple[int, ...] = ()) -> Calibration:
    """The cluster's measured :class:`Speeds` (from the cache when this cluster was measured
    before, unless ``use_cache`` is off), and where each number came from. Numbers a probe cannot
    measure here (inter-node speeds on one node) stay as declared. ``attention``: the model's
    attention shape (``ModelCost.attention_shape``), () for a model without attention."""
    spec = WorkerGroupSpec(world_size=world_size, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker,
                           env=env, wait_s=wait_s)
    bundle = spec.bundle
    try:
        placed = place_actors(CalibrationWorker, spec)
    except NoPlacementError as error:
        raise CalibrationError(f"{error}. Fix: free the cluster, or set tune.calibrate=false to use the declared "
                               "speeds") from None
    actors, slots = placed.actors, placed.slots
    try:
        hosts = ray.get([a.hostname.remote() for a in actors])
        key = {"probes": _PROBES_VERSION, "hosts": hosts, "per_node": [s.local_world_size for s in slots],
               "precision": precision, "rows": rows, "k": k, "n": n, "bundle": bundle, "attention": list(attention)}
        path = _cache_file(cache_dir, key)
        cached = _cached_speeds(path) if use_cache else None
        if cached is not None:
            nodes = len({slot.node_id for slot in slots})
            return Calibration(cached, f"measured speeds from the cache {path}", tuple(hosts), nodes,
                               _sources(gpus_per_worker > 0, nodes, max(s.local_world_size for s in slots),
                                        bool(attention)))
        by_node: dict[str, list[int]] = {}
        for slot in slots:
            by_node.setdefault(slot.node_id, []).append(slot.rank)
        # GPUs are probed all at once (they share the host's memory bandwidth and links as in
        # training). CPU workers of one node share its cores: probed together, each would time
        # an arbitrary mix of contended and free windows, so one worker per node measures a core
        # on its own and the node's share per worker is applied after (see cpu_share).
        probed = list(range(len(actors))) if gpus_per_worker else [ranks[0] for ranks in by_node.values()]
        compute = ray.get([actors[rank].compute.remote(rows, k, n, precision, attention=tuple(attention))
                           for rank in probed])
        if not gpus_per_worker:
            compute = [cpu_share(facts, len(ranks)) for facts, ranks in zip(compute, by_node.values(), strict=True)]
        master = ray.get(actors[0].address.remote())
        comm = ray.get([actor.communication.remote(slot.rank, world_size, master, list(by_node.values()), env)
                        for actor, slot in zip(actors, slots, strict=True)])
    finally:
        placed.release()

    intra = [c["intra"] for c in comm if "intra" in c]
    inter = [c["inter"] for c in comm if "inter" in c]
    # The slowest worker paces a synchronous step: take the minimum throughput across workers.
    tflops = tuple((m, min(c["tflops"][i] for c in compute)) for i, m in enumerate(rows))
    device_gb = min(c["device_gb_per_s"] for c in compute)
    gpu = "host_gb_per_s" in compute[0]
    per_node = max(len(r) for r in by_node.values())
    speeds = Speeds(
        matmul_tflops=tflops,
        intra_node_gbps=min((c["gbps"] for c in intra), default=declared.intra_node_gbps),
        inter_node_gbps=min((c["gbps"] for c in inter), default=declared.inter_node_gbps),
        intra_latency_s=max((c["latency_s"] for c in intra), default=declared.intra_latency_s),
        inter_latency_s=max((c["latency_s"] for c in inter), default=declared.inter_latency_s),
        # A link measured here is used as measured; one left as declared keeps its derating.
        intra_bus_efficiency=1.0 if intra else declared.intra_bus_efficiency,
        inter_bus_efficiency=1.0 if inter else declared.inter_bus_efficiency,
        **{f"{link}_{kind}_share": min((c[f"{kind}_share"] for c in probes), default=1.0)
           for link, probes in (("intra", intra), ("inter", inter)) for kind in ("all_gather", "reduce_scatter")},
        # On CPU workers "device" and host memory are the same RAM: a copy is also what the host link costs.
        host_link_gbps=min(c["host_link_gbps"] for c in compute) if gpu else device_gb * 8,
        device_memory_gb_per_s=device_gb,
        host_memory_gb_per_s=(min(c["host_gb_per_s"] for c in compute) if gpu else device_gb) * per_node,
        host_optimizer_params_per_s=(min(c["host_optimizer_params_per_s"] for c in compute) if gpu
                                     else declared.host_optimizer_params_per_s),
        # GPUs launch asynchronously: the fixed cost of an op hides behind the kernels before it.
        op_overhead_s=0.0 if gpu else max(c["op_overhead_s"] for c in compute),
        core_share=1.0 if gpu else min(c["share"] for c in compute),
        attention_share=min((c["attention_share"] for c in compute if "attention_share" in c), default=1.0),
        source="measured")
    measured = f"measured the cluster ({len(by_node)} node(s), {world_size} workers)"
    unwritten = _cache_speeds(path, speeds)
    note = f"{measured}; " + (f"not cached: {unwritten}" if unwritten else f"cached in {path}")
    loads: dict[str, list[dict]] = {}
    for rank, facts in zip(probed, compute, strict=True):
        if "load" in facts:  # by host: Ray nodes started on one machine share its processors
            loads.setdefault(hosts[rank], []).append(facts["load"])
    disturbed = disturbance(loads)
    sources = _sources(gpu, len(by_node), per_node, bool(attention))
    if disturbed:
        note = f"{note}; {disturbed_note(disturbed)}"
        sources = {name: source if source.startswith("declared") else f"{source} (on a busy host: {disturbed})"
                   for name, source in sources.items()}
    return Calibration(speeds, note, tuple(hosts), len(by_node), sources, disturbed)


def _sources(gpu: bool, nodes: int, per_node: int, attention: bool = False) -> dict[str, str]:
    """Where each of ``speeds``' numbers came from, as a cluster profile records it."""
    intra = "all-reduce probe inside a node (torch.distributed)"
    inter = "all-reduce probe across nodes (torch.distributed)"
    copy = "copy of 64 MB on the worker"
    sources = {"matmul_tflops": "matmul probe on the worker at the plans' heights, in the training precision",
               "device_memory_gb_per_s": copy,
               "intra_node_gbps": intra if per_node > 1 else "declared (one worker per node: no link inside a node)",
               "intra_latency_s": intra if per_node > 1 else "declared (one worker per node)",
               "inter_node_gbps": inter if nodes > 1 else "declared (one node: nothing crosses nodes)",
               "inter_latency_s": inter if nodes > 1 else "declared (one node)",
               **{f"{link}_{kind}_share": f"{call} probe over the all-reduce probe {where}" if measured else kept
                  for link, measured, where, kept in (("intra", per_node > 1, "inside a node",
                                                       "declared (one worker per node)"),
                                                      ("inter", nodes > 1, "across nodes", "declared (one node)"))
                  for kind, call in (("all_gather", "all_gather_into_tensor"),
                                     ("reduce_scatter", "reduce_scatter_tensor"))},
               "op_overhead_s": "0 on GPUs (kernels launch asynchronously)" if gpu
               else "forward and backward of a small MLP, per op",
               "core_share": "1 on GPUs" if gpu else "the node's cores over its workers' threads",
               "attention_share": ("scaled_dot_product_attention forward and backward at the model's attention shape, "
                                   "over the matmul probe at the same rows") if attention
               else "declared (the model calls no scaled_dot_product_attention: attention priced as matmuls)"}
    if gpu:
        sources.update(host_link_gbps="pinned host-to-device copies", host_memory_gb_per_s="copy in host memory",
                       host_optimizer_params_per_s="fused CPU AdamW step over 32 M parameters")
    else:
        sources.update(host_link_gbps="the worker's copy (host and device are the same memory)",
                       host_memory_gb_per_s="the worker's copy times the node's workers",
                       host_optimizer_params_per_s="declared (its probe runs on GPU workers only)")
    return sources


def _cache_speeds(path: Path, speeds: Speeds) -> str | None:
    """Write ``speeds`` to the cache at ``path``, whole or not at all; why it could not be, or None.
    A cache that cannot be written costs the next tune a measurement, not this one its result."""
    doc = asdict(speeds)
    doc.pop("source")
    try:
        write_whole(path, json.dumps(doc, indent=2))
    except OSError as error:
        return f"{path} could not be written ({error.strerror or error})"
    return None


def _cached_speeds(path: Path) -> Speeds | None:
    """The speeds cached at ``path`` (plain JSON, never unpickled), or None when there are none to use:
    no file, or one that cannot be read as this version's speeds (measured again, then replaced)."""
    try:
        doc = json.loads(path.read_text())
        # JSON has no tuples: the pairs come back as lists.
        for pairs in ("matmul_tflops", "matmul_tiles", "phase_scale"):
            if pairs in doc:
                doc[pairs] = tuple(tuple(pair) for pair in doc[pairs])
        speeds = Speeds(**doc, source="measured")
    except (OSError, ValueError, TypeError):
        return None
    return None if speeds_problems(speeds) else speeds
