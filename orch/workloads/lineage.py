"""Content digests of the data a run trains on, for its MLflow dataset input.

The same data gives the same digest: files are hashed byte for byte (a file larger than
:data:`WHOLE_FILE_LIMIT` through its size and :data:`FILE_CHUNKS` evenly spaced chunks, so a
launch never reads terabytes to name its data); a dataset that exists
only as Python objects (a user's ``Dataset``, a package's bundled arrays) is hashed through its
length and the tensors of up to :data:`SAMPLED_ITEMS` evenly spaced samples, which reading
every sample of a large dataset would make too slow to do at every launch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

SAMPLED_ITEMS = 64
"""Samples of a Python dataset that go into its digest."""
WHOLE_FILE_LIMIT = 256 * 2**20
"""Files up to this size are hashed whole."""
FILE_CHUNKS = 64
CHUNK = 2**20


def files_digest(paths: Iterable[Path]) -> tuple[str, int]:
    """(SHA-256 of the files' bytes in order, their total size in bytes)."""
    digest, total = hashlib.sha256(), 0
    for path in paths:
        size = Path(path).stat().st_size
        digest.update(f"{size}|".encode())
        with open(path, "rb") as handle:
            if size <= WHOLE_FILE_LIMIT:
                for chunk in iter(lambda: handle.read(CHUNK), b""):
                    digest.update(chunk)
            else:
                for i in range(FILE_CHUNKS):
                    handle.seek(i * (size - CHUNK) // (FILE_CHUNKS - 1))
                    digest.update(handle.read(CHUNK))
        total += size
    return digest.hexdigest(), total


def samples_digest(dataset: Any, salt: str = "") -> str:
    """SHA-256 of ``salt``, the dataset's length and the values of up to :data:`SAMPLED_ITEMS`
    evenly spaced samples (tensors by their bytes, anything else by its ``repr``)."""
    digest = hashlib.sha256(f"{salt}|{len(dataset)}".encode())
    count = len(dataset)
    for index in sorted({i * count // SAMPLED_ITEMS for i in range(min(count, SAMPLED_ITEMS))}):
        for leaf in tree_flatten(dataset[index])[0]:
            if isinstance(leaf, torch.Tensor):
                digest.update(str((leaf.dtype, tuple(leaf.shape))).encode())
                digest.update(leaf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(leaf).encode())
    return digest.hexdigest()
