"""Endless, resumable micro-batches of any map-style dataset for one data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ShardedBatches:
    """Endless micro-batches for one data-parallel rank.

    Uses :class:`torch.utils.data.DistributedSampler`, so each dp rank reads a disjoint
    shard; every pass over the data reshuffles with the epoch as seed, identically on all
    ranks. :meth:`state_dict` (epoch and batches drawn in it) is what a checkpoint saves, so a
    resumed run reads exactly the batches the interrupted one would have read next.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, collate: Callable[[list], Any] | None = None):
        if len(dataset) < dp_size * batch_size:
            raise ValueError(f"data too small: {len(dataset)} samples for dp({dp_size}) * "
                             f"micro_batch_size({batch_size})")
        self.sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                                  drop_last=True, collate_fn=collate)
        self.epoch = 0
        self.position = 0
        """Batches drawn in the current epoch."""
        self._it = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state``: the same epoch's order, skipping the batches already drawn."""
        self.epoch, self.position = int(state["epoch"]), 0
        self._it = None
        for _ in range(int(state["position"])):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
                self.position += 1
                return batch
            except StopIteration:
                self.epoch += 1
                self.position = 0
                self._it = None

    def sample_batch(self) -> Any:
        """One batch of the split, outside the saved position (the export's reference batch)."""
        return next(iter(self.loader))


class StreamedBatches:
    """Endless micro-batches of one data-parallel replica's Ray Data stream.

    ``stream`` is the replica's ``DataIterator`` of a ``streaming_split``; each pass over it is an
    epoch (the splits are equal, so every replica ends its epoch at the same batch and they all
    start the next together). ``to_batch`` turns Ray's dict of column tensors into the model's
    batch. The state a checkpoint saves is the epoch and the batches drawn in it; a stream's order
    is not reproducible, so :meth:`load_state_dict` restarts the saved epoch from its beginning.
    """

    def __init__(self, stream: Any, *, batch_size: int, seed: int, to_batch: Callable[[dict], Any],
                 shuffle_buffer: int = 0):
        self.stream, self.batch_size, self.seed = stream, batch_size, seed
        self.to_batch, self.shuffle_buffer = to_batch, shuffle_buffer
        self.epoch = 0
        self.position = 0
        """Batches drawn in the current epoch."""
        self._it = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved epoch, from its beginning."""
        self.epoch, self.position, self._it = int(state["epoch"]), 0, None

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        for _ in range(2):
            if self._it is None:
                shuffle = {"local_shuffle_buffer_size": self.shuffle_buffer,
                           "local_shuffle_seed": self.seed + self.epoch} if self.shuffle_buffer else {}
                self._it = iter(self.stream.iter_torch_batches(batch_size=self.batch_size, drop_last=True,
                                                               **shuffle))
            try:
                batch = next(self._it)
                self.position += 1
                return self.to_batch(batch)
            except StopIteration:
                self.epoch += 1
                self.position = 0
                self._it = None
        raise RuntimeError(f"the data stream of epoch {self.epoch} yielded no micro-batch of {self.batch_size} "
                           "samples: the data is smaller than dp * micro_batch_size")

    def sample_batch(self) -> Any:
        return next(self)


class ReplicaBatches:
    """The batches of one data-parallel replica, shared by the ranks that read them.

    The ranks of one tensor-parallel group, and a pipeline's first and last stages (which take
    the inputs and the labels), must see the same batch, but a stream split has one consumer.
    The replica's first rank (``source``) reads, and sends each batch with its position to the
    replica's other readers (``peers``) over ``group``, a gloo group of the replica's readers.

    The sends do not wait: a collective would deadlock a pipeline, whose first stage loads its
    next micro-batch while the last stage still waits for the activations of the previous one.
    Batches go as ``torch.save`` bytes and are read with ``weights_only`` loading (tensors and
    plain containers only). ``tag`` keeps the training and the evaluation stream apart.
    """

    def __init__(self, source: StreamedBatches | None, *, group: Any, src: int, peers: list[int], tag: int):
        self.source, self.group, self.src, self.peers, self.tag = source, group, src, peers, tag
        self._state = {"epoch": 0, "position": 0}
        self._in_flight: list[tuple[Any, ...]] = []

    def state_dict(self) -> dict[str, int]:
        return self.source.state_dict() if self.source is not None else dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)
        self._state = dict(state)

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self.group is None:
            return next(self.source)
        if self.source is not None:
            batch = next(self.source)
            self._send((batch, self.source.state_dict()))
            return batch
        batch, self._state = self._receive()
        return batch

    def _send(self, message: Any) -> None:
        import io

        import torch
        import torch.distributed as dist

        buffer = io.BytesIO()
        torch.save(message, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        # Each send keeps its tensors alive until it completes.
        self._in_flight = [sent for sent in self._in_flight if not sent[0].is_completed()]
        for peer in self.peers:
            for tensor in (size, data):
                self._in_flight.append((dist.isend(tensor, peer, group=self.group, tag=self.tag), tensor))

    def _receive(self) -> Any:
        import io

        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.long)
        dist.recv(size, self.src, group=self.group, tag=self.tag)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, self.src, group=self.group, tag=self.tag)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def sample_batch(self) -> Any:
        return next(self)
