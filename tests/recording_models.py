"""Models that record what they were given, to check which samples each rank trained on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torchvision.ops import MLP


class RowRecorder(torch.nn.Module):
    """An MLP classifier of ``x`` that appends the ``row`` ids of every training batch it sees to
    ``record_dir/rank<RANK>-<pid>.txt`` (a line per batch), so a test can check coverage. It takes
    ``labels`` as Hugging Face models do (a dict batch is passed whole) and leaves the loss to the objective.

    While ``record_dir/kill-rank1-at-batch-N`` exists, rank 1 removes it and kills itself with
    SIGKILL in its N-th training batch: a worker dying at a known step, once.
    """

    def __init__(self, in_channels: int, hidden_channels: list[int], record_dir: str):
        super().__init__()
        self.mlp = MLP(in_channels, hidden_channels)
        self.record_dir = record_dir
        self.batches = 0

    def forward(self, x: torch.Tensor, row: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and row.device.type != "meta":
            path = Path(self.record_dir, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.txt")
            with open(path, "a") as handle:
                handle.write(" ".join(str(int(r)) for r in row.tolist()) + "\n")
            self.batches += 1
            self._maybe_die()
        return self.mlp(x)

    def _maybe_die(self) -> None:
        if os.environ.get("RANK") != "1":
            return
        for marker in Path(self.record_dir).glob("kill-rank1-at-batch-*"):
            if int(marker.name.rsplit("-", 1)[1]) == self.batches:
                marker.unlink()
                os.kill(os.getpid(), signal.SIGKILL)
