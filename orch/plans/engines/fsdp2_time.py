"""FSDP2's data-parallel time: the term :mod:`orch.plans.step_time.cost_model` prices as ZeRO-3's, as FSDP2 runs it.

:func:`orch.plans.engine_settings.engine_settings` maps an FSDP2 plan onto ZeRO stage 3 (it shards the same
states), so :func:`orch.plans.step_time.cost_model.predict_step` already prices an all-gather of every parameter
in forward and backward and a reduce-scatter of the gradients, every micro-batch. FSDP2 differs in
what it moves and how often (torch/distributed/fsdp/_fully_shard/):

- it gathers one ``fully_shard`` unit at a time (a block, and the root: the embeddings, the head),
  so a micro-batch makes one all-gather call per unit, not one per parameter-owning module;
- with ``reshard_after_forward`` each block is gathered again for its backward
  (``FSDPParamGroup.reshard`` in forward, ``pre_backward`` -> ``unshard``); without it, once. The
  root is not resharded after forward (``fully_shard`` sets ``reshard_after_forward=False`` on the
  root), so it is gathered once per micro-batch either way. Activation checkpointing adds no
  gather: the recomputed forward runs inside the block's backward, while it is gathered;
- gradients are reduce-scattered in ``MixedPrecisionPolicy.reduce_dtype`` (fp32: 4 bytes per
  element, twice what a bf16 reduction moves), every micro-batch (``foreach_reduce``); in
  pipeline stages once per step, after the last micro-batch, torch's schedules holding the
  gradients unreduced and the parameters gathered until then;
- the all-gathers and reduce-scatters run at their own rates (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``: :meth:`orch.plans.step_time.cost_model.Speeds.bus_gbps`), which
  calibration measures: NCCL's match its all-reduce's, gloo's are a quarter to a half of it;
- with HSDP (``plan.fsdp.hybrid``) the gathers and reduce-scatters stay inside a node and the
  reduced shard is all-reduced across the replicas (``foreach_reduce``'s ``all_reduce_group``);
- on GPUs the all-gather of the next block is issued while the current one computes (implicit
  prefetch in forward, ``_backward_prefetch`` in backward) and the reduce-scatters run on their
  own stream: only what the compute cannot cover stays exposed. CPU workers (gloo) are counted
  without overlap, as the cost model counts every CPU collective.

:func:`predict_fsdp_step` is :func:`orch.plans.step_time.cost_model.predict_step` with this term in place of the
ZeRO-3 one; the FSDP2 spec (:mod:`orch.plans.engines.fsdp2`) answers the planner's step time with
it, so the cost model itself knows no engine.
"""

from __future__ import annotations

import dataclasses
import math

from orch.plans.engine_settings import engine_settings
from orch.plans.engines.fsdp2_memory import fsdp_mesh
from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import Accelerator, OptimSpec
from orch.plans.step_time.cost_model import (
    ModelCost,
    Speeds,
    StepTime,
    _allreduce_s,
    _half_ring_s,
    _members_per_node,
    group_links,
    predict_step,
)

REDUCE_BYTES = 4
"""Bytes of one reduced gradient element: the FSDP2 engine reduces in fp32 (``reduce_dtype``)."""


def fsdp_dp_comm_s(plan: ResolvedPlan, model: ModelCost, speeds: Speeds, *, devices_per_node: int,
                   root_params: float = 0.0, exposed_compute_s: float = 0.0) -> float:
    """Seconds of FSDP2's all-gathers, reduce-scatters and (HSDP) all-reduces in one optimizer step.

    ``root_params`` are the parameters outside every block one tensor-parallel rank holds
    (gathered once per micro-batch);
    ``exposed_compute_s`` the step's compute that prefetching can hide communication behind (0:
    no overlap, as on CPU workers).
    """
    mesh = fsdp_mesh(plan, devices_per_node)
    if mesh.shard <= 1 and mesh.replicate <= 1:
        return 0.0
    tp, pp, m = plan.tp, plan.pp, plan.grad_accum_steps
    # A pipeline rank shards only its stages' layers: 1/pp of the blocks (the root's share, the
    # embedding and head, sits on the first and last stage: counted whole, the busiest rank's).
    layers = max(math.ceil(model.n_layers / pp), 1)
    params = model.tp_param_count.get(tp, model.param_count / tp)
    root = min(root_params, params)
    blocks = (params - root) / pp
    params = blocks + root
    units = layers + (1 if root else 0)
    b = plan.precision.element_bytes
    lat = {"intra": speeds.intra_latency_s, "inter": speeds.inter_latency_s}
    if plan.cp > 1 and pp > 1:
        # The shard group is one stage's data- and context-parallel ranks (orch.plans.parallel.rank_layout):
        # cp neighbours tp ranks apart, dp such blocks tp * cp * pp ranks apart.
        span = (plan.cp - 1) * tp + (plan.dp - 1) * tp * plan.cp * pp
        shard_link = "inter" if span >= devices_per_node else "intra"
        shard_members = (_members_per_node(tp, plan.cp, devices_per_node)
                         * _members_per_node(tp * plan.cp * pp, plan.dp, devices_per_node))
    else:
        # The shard group: consecutive data-parallel ranks (and context-parallel ones, their
        # neighbours without stages), tp * pp ranks apart.
        shard_link = group_links(tp * pp * mesh.shard, devices_per_node, tp, pp).dp
        shard_members = _members_per_node(tp * pp, mesh.shard, devices_per_node)
    gather_bw = speeds.bus_gbps(shard_link, shard_members, collective="all_gather")
    scatter_bw = speeds.bus_gbps(shard_link, shard_members, collective="reduce_scatter")
    reshard = plan.fsdp.reshard_after_forward
    if pp > 1:
        # torch's pipeline schedules keep a stage's parameters gathered and its gradients unreduced
        # across the step's micro-batches (PipelineStage.backward_maybe_with_nosync turns off the
        # reshard after backward and the gradient sync) and reduce once, after the last
        # (perform_reduce_grad). Without reshard_after_forward the blocks are gathered once per
        # step; with it each forward reshards them and each backward gathers them again.
        block_gathers, root_gathers, reductions = (m + 1 if reshard else 1), 1, 1
    else:
        block_gathers, root_gathers, reductions = m * (2 if reshard else 1), m, m
    gathers_s = reductions_s = 0.0
    if mesh.shard > 1:
        gathers_s = (_half_ring_s(b * blocks * block_gathers, mesh.shard, gather_bw, lat[shard_link],
                                  calls=layers * block_gathers)
                     + (_half_ring_s(b * root * root_gathers, mesh.shard, gather_bw, lat[shard_link],
                                     calls=root_gathers) if root else 0.0))
        reductions_s = reductions * _half_ring_s(REDUCE_BYTES * params, mesh.shard, scatter_bw, lat[shard_link],
                                                 calls=units)
    if mesh.replicate > 1:
        replica_link = group_links(plan.world_size, devices_per_node, tp * mesh.shard, 1).dp
        replica_bw = speeds.bus_gbps(replica_link, _members_per_node(tp * mesh.shard, mesh.replicate,
                                                                     devices_per_node))
        reductions_s += reductions * _allreduce_s(REDUCE_BYTES * params / mesh.shard, mesh.replicate, replica_bw,
                                                  lat[replica_link], calls=units)
    total = gathers_s + reductions_s
    if exposed_compute_s <= 0:
        return total
    # Prefetching hides every unit's collectives but the first gather and the last reduction
    # behind the compute of its neighbours, as far as that compute lasts.
    unhidden = total / max(units, 1)
    return max(total - exposed_compute_s, unhidden)


def predict_fsdp_step(plan: ResolvedPlan, model: ModelCost, speeds: Speeds, *, devices_per_node: int,
                      optim: OptimSpec, root_params: float = 0.0) -> StepTime:
    """:func:`orch.plans.step_time.cost_model.predict_step` of an FSDP2 plan, its ZeRO-3 data-parallel term
    replaced by :func:`fsdp_dp_comm_s` (rates rescaled to the new total)."""
    step = predict_step(plan, model, speeds, devices_per_node=devices_per_node, optim=optim)
    overlap = engine_settings(plan, optim).overlap_comm and plan.accelerator == Accelerator.gpu
    dp_s = fsdp_dp_comm_s(plan, model, speeds, devices_per_node=devices_per_node, root_params=root_params,
                          exposed_compute_s=step.compute_s + step.memory_s if overlap else 0.0)
    replaced = dataclasses.replace(step, dp_comm_s=dp_s)
    scale = step.total_s / replaced.total_s
    return dataclasses.replace(replaced, tokens_per_s=step.tokens_per_s * scale,
                               tflops_per_device=step.tflops_per_device * scale,
                               model_tflops_per_device=step.model_tflops_per_device * scale)

