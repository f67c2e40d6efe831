"""A byte-level text corpus: ``data=corpus``, the default data source.

The shipped corpus (``corpus.txt.gz``, ~500 KB of English prose: the docstrings of the Python
standard library, rebuilt by ``orch/workloads/make_corpus.py``) is small enough to ship and real
enough that a falling loss means the model learns something. Any UTF-8 text file can replace
it through ``data.path``.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orch.plans.errors import Violation
from orch.workloads.lineage import files_digest
from orch.workloads.local_files import missing_reason
from orch.workloads.schemas import CorpusDataConfig, from_schema

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


_CORPUS_FIX = "point data.path at a text file (optionally .gz), or set data.path=null for the shipped corpus"


@dataclass(frozen=True, kw_only=True)
class CorpusSource:
    """The corpus as a :class:`orch.plans.model.workload.DataSource`: windows of ``seq_len + 1`` bytes as
    ``(inputs, next-byte targets)`` pairs; the tail ``val_fraction`` is held out."""

    path: str | None = from_schema(CorpusDataConfig, "path")
    seq_len: int = from_schema(CorpusDataConfig, "seq_len")
    val_fraction: float = from_schema(CorpusDataConfig, "val_fraction")

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    @property
    def required_outputs(self) -> int:
        return BYTE_VOCAB

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        """The corpus must exist, be readable and give ``samples_per_step`` windows to both training
        and evaluation (one step of a plan needs ``dp * micro_batch_size``)."""
        windows = samples_per_step
        shown = self.path if self.path else "the shipped corpus"
        if self.path:
            path = Path(self.path)
            if why := missing_reason(path):
                return [Violation("data.path", self.path, why, _CORPUS_FIX)]
            if not path.is_file():
                return [Violation("data.path", self.path, "is not a regular file (a directory?).", _CORPUS_FIX)]
        if windows < 1 or self.seq_len < 1 or not 0 < self.val_fraction < 1:
            return []  # sizes out of range are reported by the range checks; nothing to count against
        window_bytes = windows * self.seq_len + 1
        # Both parts of the split need window_bytes; reading more than this proves nothing more.
        enough = math.ceil(window_bytes / min(self.val_fraction, 1 - self.val_fraction)) + 2
        try:
            n_bytes = byte_count(self.path, enough)
        # Unreadable, not gzip at all (gzip.BadGzipFile is an OSError), truncated (EOFError) or corrupt (zlib.error).
        except (OSError, EOFError, zlib.error) as error:
            reason = (error.strerror if isinstance(error, OSError) and error.strerror
                      else str(error) or type(error).__name__)
            return [Violation("data.path", shown, f"cannot be read: {reason}.", _CORPUS_FIX)]
        n_train, n_val = split_sizes(n_bytes, self.val_fraction)
        train_windows, val_windows = window_count(n_train, self.seq_len), window_count(n_val, self.seq_len)
        if train_windows >= windows and val_windows >= windows:
            return []
        arithmetic = (f"its {n_bytes:,} bytes split by data.val_fraction={self.val_fraction:g} into {n_train:,} "
                      f"training and {n_val:,} evaluation bytes give {train_windows} and {val_windows} windows of "
                      f"data.seq_len + 1 = {self.seq_len + 1} bytes; each part needs {windows}")
        if train_windows >= windows:
            return [Violation("data.val_fraction", self.val_fraction,
                              f"the evaluation part of {shown} is too small: {arithmetic}.",
                              "raise data.val_fraction, use a larger corpus or a smaller data.seq_len")]
        return [Violation("data.path", shown, f"the corpus is too small: {arithmetic}.",
                          f"use a larger corpus, or a smaller data.seq_len; {_CORPUS_FIX}")]

    def sizes(self) -> tuple[int, int]:
        n_train, n_val = split_sizes(byte_count(self.path, 1 << 62), self.val_fraction)
        return window_count(n_train, self.seq_len), window_count(n_val, self.seq_len)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, self.seq_len)
        return (torch.zeros(shape, dtype=torch.long, device="meta"),
                torch.zeros(shape, dtype=torch.long, device="meta"))

    def prepare(self) -> None:
        """Nothing to build: the corpus is read as it is."""

    def datasets(self) -> tuple[ByteWindows, ByteWindows]:
        train, val = split(load_bytes(self.path), self.val_fraction)
        return ByteWindows(train, self.seq_len), ByteWindows(val, self.seq_len)

    def collate(self) -> Callable[[list], Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        source = Path(self.path) if self.path else SHIPPED_CORPUS
        digest, size = files_digest([source])
        return {"name": source.name, "source": str(source.resolve()), "size": size, "unit": "bytes",
                "digest": digest, "seq_len": self.seq_len}
