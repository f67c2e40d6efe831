"""Read the live Ray cluster: nodes, their host memory, and the memory of their GPUs.

The planner checks a plan against these facts instead of the declared ``cluster`` numbers
whenever a cluster is reachable, so a plan is never approved for hardware that is not there.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orch.plans.cluster_facts import NodeFacts


def _host_facts() -> dict:
    import psutil

    return {"host_memory_bytes": psutil.virtual_memory().total}


def _gpu_memory() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def discover_nodes(timeout_s: float = 60.0) -> list[NodeFacts]:
    """Facts of every alive node, measured by a tiny task pinned to each node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    host_task = ray.remote(num_cpus=0)(_host_facts)
    gpu_task = ray.remote(num_cpus=0, num_gpus=1)(_gpu_memory)
    host_refs, gpu_refs = [], []
    for node in nodes:
        pin = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        host_refs.append(host_task.options(scheduling_strategy=pin).remote())
        has_gpu = node["Resources"].get("GPU", 0) >= 1
        gpu_refs.append(gpu_task.options(scheduling_strategy=pin).remote() if has_gpu else None)
    hosts = ray.get(host_refs, timeout=timeout_s)
    facts = []
    for node, host, gpu_ref in zip(nodes, hosts, gpu_refs, strict=True):
        gpu_memory = ray.get(gpu_ref, timeout=timeout_s) if gpu_ref is not None else None
        facts.append(NodeFacts(node_id=node["NodeID"], address=node["NodeManagerAddress"],
                               cpus=node["Resources"].get("CPU", 0.0), gpus=node["Resources"].get("GPU", 0.0),
                               host_memory_bytes=host["host_memory_bytes"], gpu_memory_bytes=gpu_memory))
    return facts
