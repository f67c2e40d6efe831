"""Reconciling the declared cluster with a live one is pure: checked here without Ray."""

from __future__ import annotations

from orch.plans.cluster_facts import GIB, NodeFacts, reconcile
from orch.plans.spec import Accelerator, ClusterSpec


def node(i: int, *, cpus: float = 1, gpus: float = 0, host_gib: float = 24, gpu_gib: float | None = None):
    return NodeFacts(f"n{i}", f"10.0.0.{i}", cpus, gpus, int(host_gib * GIB),
                     int(gpu_gib * GIB) if gpu_gib else None)


def test_cpu_nodes_supply_host_memory_and_cap_each_workers_share():
    declared = ClusterSpec(address="auto", nodes=2, devices_per_node=1, host_memory_gib=1, device_memory_gib=64)
    cluster, violations, notes = reconcile(declared, [node(0, host_gib=16), node(1, host_gib=12)])
    assert violations == []
    assert cluster.host_memory_gib == 12 and cluster.device_memory_gib == 12
    assert any("host_memory_gib: declared 1" in n for n in notes)


def test_gpu_memory_is_read_from_the_devices():
    declared = ClusterSpec(address="auto", nodes=1, devices_per_node=8, accelerator=Accelerator.gpu,
                           device_memory_gib=80)
    cluster, violations, notes = reconcile(declared, [node(0, cpus=64, gpus=8, host_gib=512, gpu_gib=39.5)])
    assert violations == [] and cluster.device_memory_gib == 39.5
    assert any("the live cluster's GPUs have 39.50" in n for n in notes)


def test_a_declared_cluster_larger_than_the_live_one_is_a_violation_with_the_arithmetic():
    declared = ClusterSpec(address="auto", nodes=3, devices_per_node=1)
    _, violations, _ = reconcile(declared, [node(0), node(1)])
    assert [v.field for v in violations] == ["cluster.nodes"]
    assert "cluster.nodes(3) * cluster.devices_per_node(1) = 3 workers, but the live cluster has room for 2" in \
        violations[0].message
