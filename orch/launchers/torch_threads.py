"""Torch's intra-op thread pool, sized to the CPUs Ray gave the actor."""

from __future__ import annotations

import os


def match_torch_threads() -> None:
    """Size torch's intra-op thread pool to ``OMP_NUM_THREADS``, which Ray sets to the actor's
    CPUs when the actor is placed.

    OpenMP reads the variable once, when torch is loaded: a process that imported torch before
    it was placed (a cluster whose Ray preloads modules into its idle workers,
    ``preload_python_modules``) would otherwise run one thread per core of the node in every
    rank, and ranks sharing a node would slow each other down.
    """
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit() or int(threads) < 1:
        return
    import torch

    if torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
