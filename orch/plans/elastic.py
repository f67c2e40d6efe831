"""The arithmetic of an elastic run (``train.elastic``): what it needs declared, the shape of the
cluster that survives a loss, and the global batches a re-plan may train at.

Pure and torch-free: the driver (:mod:`orch.run.elastic`) reads the live cluster and searches.
"""

from __future__ import annotations

from orch.plans.engines import engine_names, engine_spec
from orch.plans.errors import Violation
from orch.plans.spec import ClusterSpec, PlanSpec, TrainSpec


def elastic_violations(train: TrainSpec, plan: PlanSpec) -> list[Violation]:
    """What an elastic run needs besides its own bounds: checkpoints to resume from, a restart to
    spend, and checkpoints its engine can resume on fewer devices."""
    if not train.elastic.enabled:
        if train.elastic.exclude_stragglers:
            return [Violation("train.elastic.exclude_stragglers", True,
                              "leaving a straggler's node out is a re-plan, which elastic runs make.",
                              "set train.elastic.enabled=true as well, or train.elastic.exclude_stragglers=false")]
        return []
    found = []
    if not train.checkpoint_every:
        found.append(Violation("train.checkpoint_every", train.checkpoint_every,
                               "train.elastic.enabled=true resumes the survivors from the run's last checkpoint, "
                               "and this run writes none: a re-plan would start the training over.",
                               "set train.checkpoint_every (e.g. 100), or train.elastic.enabled=false"))
    if not train.max_failures:
        found.append(Violation("train.max_failures", train.max_failures,
                               "a re-plan after a lost node restarts the worker group, and train.max_failures=0 "
                               "allows no restart.",
                               "set train.max_failures to the restarts (re-plans included) the run may take, "
                               "e.g. train.max_failures=3"))
    if plan.engine in engine_names():  # an unknown engine is refused with the plan's problems
        found += engine_spec(plan.engine).elastic_violations(plan)
    return found


def surviving_shapes(slots_per_node: list[int], declared: ClusterSpec) -> list[tuple[int, int]]:
    """Every uniform ``(nodes, devices_per_node)`` shape the live nodes hold, most devices first (ties:
    more devices per node, where tensor parallelism stays inside a node), never more nodes or devices
    per node than declared: a plan is made for nodes of one size, so a node with fewer free slots
    limits the others unless it is left out. A re-plan tries them in this order: the largest may
    allow no plan the checkpoint resumes (8-GPU nodes left with 7 cannot hold tp=8), a smaller one may."""
    shapes = []
    for per_node in range(1, declared.devices_per_node + 1):
        nodes = min(sum(1 for slots in slots_per_node if slots >= per_node), declared.nodes)
        if nodes:
            shapes.append((nodes, per_node))
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape[1]), reverse=True)


def surviving_shape(slots_per_node: list[int], declared: ClusterSpec) -> tuple[int, int]:
    """The largest of :func:`surviving_shapes`; ``(0, 0)`` when no node has a slot."""
    shapes = surviving_shapes(slots_per_node, declared)
    return shapes[0] if shapes else (0, 0)


def batch_sizes_to_try(global_batch: int, tolerance: float, world_size: int) -> list[int]:
    """The global batches a re-plan on ``world_size`` devices may train at, closest first: the run's
    own, then the nearest multiple of each data-parallel degree the devices allow, within
    ``tolerance`` of it (a share)."""
    sizes = {global_batch}
    for dp in range(1, world_size + 1):
        if world_size % dp:
            continue
        for multiple in (global_batch // dp * dp, -(-global_batch // dp) * dp):
            if multiple >= dp and abs(multiple - global_batch) <= tolerance * global_batch:
                sizes.add(multiple)
    return sorted(sizes, key=lambda size: (abs(size - global_batch), size))
