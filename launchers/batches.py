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
