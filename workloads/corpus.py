"""A byte-level text corpus and a data-parallel sharded loader over it.

The shipped corpus (``corpus.txt.gz``, ~500 KB of English prose: the docstrings of the Python
standard library, rebuilt by ``workloads/make_corpus.py``) is small enough to ship and real
enough that a falling loss means the model learns something. Any UTF-8 text file can replace
it through ``data.path``.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

SHIPPED_CORPUS = Path(__file__).with_name("corpus.txt.gz")
BYTE_VOCAB = 256


def load_bytes(path: str | None = None) -> torch.Tensor:
    """Return the corpus as a 1-D uint8 tensor of bytes."""
    source = Path(path) if path else SHIPPED_CORPUS
    raw = gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def byte_count(path: str | None, limit: int) -> int:
    """Bytes of the corpus at ``path`` (the shipped one for None), counted up to ``limit``.

    A plain file's size is read off the file system; a ``.gz`` file is decompressed only as far
    as ``limit``. Raises OSError (gzip.BadGzipFile, EOFError for a truncated archive) as reading it would."""
    source = Path(path) if path else SHIPPED_CORPUS
    if source.suffix != ".gz":
        return min(source.stat().st_size, limit)
    counted = 0
    with gzip.open(source, "rb") as stream:
        while counted < limit:
            chunk = stream.read(min(1 << 20, limit - counted))
            if not chunk:
                break
            counted += len(chunk)
    return counted


def window_count(n_bytes: int, seq_len: int) -> int:
    """Samples of :class:`ByteWindows` over ``n_bytes``: windows of ``seq_len + 1`` bytes, each
    starting where the previous one's inputs end (the last byte is the next window's first input)."""
    return max((n_bytes - 1) // seq_len, 0)


def split_sizes(n_bytes: int, val_fraction: float) -> tuple[int, int]:
    """Bytes of the training and evaluation parts of :func:`split`."""
    n_val = int(n_bytes * val_fraction)
    return n_bytes - n_val, n_val


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return window_count(len(self.data), self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def split(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out the tail of the corpus for evaluation."""
    n_train, _ = split_sizes(len(data), val_fraction)
    return data[:n_train], data[n_train:]


class ShardedBatches:
    """Endless micro-batches for one data-parallel rank.

    Uses :class:`torch.utils.data.DistributedSampler`, so each dp rank reads a disjoint
    shard; every pass over the data reshuffles with the epoch as seed, identically on all
    ranks. :meth:`state_dict` (epoch and batches drawn in it) is what a checkpoint saves, so a
    resumed run reads exactly the batches the interrupted one would have read next.
    """

    def __init__(self, dataset: ByteWindows, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        if len(dataset) < dp_size * batch_size:
            raise ValueError(f"corpus too small: {len(dataset)} windows for dp({dp_size}) * "
                             f"micro_batch_size({batch_size})")
        self.sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                                  drop_last=True)
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

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
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
