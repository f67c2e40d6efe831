"""A rank's training and evaluation batches: its shard of a map-style dataset, or its replica's
share of a streamed source; and the fingerprint tests compare the batches ranks read by."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from orch.launchers.job import TrainJob
from orch.plans.parallel.rank_layout import ParallelCoords, global_rank


def digest(batch) -> str:
    """A fingerprint of a batch of any structure (tests compare the batches ranks read)."""
    import torch
    from torch.utils._pytree import tree_flatten

    sha = hashlib.sha1()
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            sha.update(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            sha.update(repr(leaf).encode())
    return sha.hexdigest()


def rank_batches(job: TrainJob, rank: int, coords: ParallelCoords, streams: tuple[Any, Any] | None):
    """``(training, evaluation, data_tensor_bytes)`` of this rank.

    The ranks of one tensor-parallel group hold shards of one replica: they read the same batch.
    ``data_tensor_bytes`` is what the data's own tensors (an in-memory corpus, decoded images)
    take, counted when the run probes memory: the measured memory is compared with the
    planner's prediction without them.
    """
    from orch.launchers.batches import ShardedBatches
    from orch.launchers.memory_probe import TensorsMade
    from orch.plans.model.workload import StreamingSource

    plan, data = job.plan, job.workload.data
    data_tensors = TensorsMade() if job.train.memory_probe_step else contextlib.nullcontext()
    with data_tensors:
        if isinstance(data, StreamingSource):
            batches, val_batches = _streamed_batches(job, rank, coords, streams)
        else:
            data.prepare()
            train_set, val_set = data.datasets()
            collate = data.collate()
            batches = ShardedBatches(train_set, batch_size=plan.micro_batch_size, dp_rank=coords.dp_rank,
                                     dp_size=plan.dp, seed=job.train.seed, collate=collate)
            val_batches = ShardedBatches(val_set, batch_size=plan.micro_batch_size, dp_rank=coords.dp_rank,
                                         dp_size=plan.dp, seed=job.train.seed, shuffle=False, collate=collate)
    return batches, val_batches, data_tensors.bytes if job.train.memory_probe_step else 0


def _streamed_batches(job: TrainJob, rank: int, coords: ParallelCoords, streams: tuple[Any, Any] | None):
    """Training and evaluation batches of a streamed source, shared within each replica.

    A replica's readers are its ranks that take batches: every tensor- and context-parallel rank, of the
    first and the last pipeline stage only (the stages between receive activations). Every
    rank creates every replica's group, as ``new_group`` requires, in the same order.
    """
    import torch.distributed as dist

    from orch.launchers.batches import ReplicaBatches, StreamedBatches

    plan, data = job.plan, job.workload.data
    readers_of = []
    for dp_rank in range(plan.dp):
        stages = sorted({0, plan.pp - 1})
        readers_of.append([global_rank(dp_rank, stage, tp_rank, tp=plan.tp, pp=plan.pp, cp_rank=cp_rank, cp=plan.cp)
                           for stage in stages for cp_rank in range(plan.cp) for tp_rank in range(plan.tp)])
    groups = [dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None for ranks in readers_of]
    readers = readers_of[coords.dp_rank]
    group = groups[coords.dp_rank]
    if rank == readers[0] and streams is None:
        raise RuntimeError(f"rank {rank} leads data-parallel replica {coords.dp_rank} but got no data stream")
    pair = []
    for index, shuffle in ((0, data.shuffle_buffer), (1, 0)):
        source = None
        if rank == readers[0]:
            source = StreamedBatches(streams[index], batch_size=plan.micro_batch_size, seed=job.train.seed,
                                     to_batch=data.to_batch(), shuffle_buffer=shuffle)
        pair.append(ReplicaBatches(source, group=group, src=readers[0], peers=readers[1:], tag=index))
    return pair[0], pair[1]
