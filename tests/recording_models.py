"""Models that record what they were given, to check which samples each rank trained on."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch
from torchvision.ops import MLP


class RowRecorder(torch.nn.Module):
    """An MLP classifier of ``x`` that appends the ``row`` ids of every training batch it sees to
    ``record_dir/rank<RANK>-<pid>.txt`` (a line per batch), so a test can check coverage. It takes
    ``labels`` as Hugging Face models do (a dict batch is passed whole) and leaves the loss to the objective.

    While ``record_dir/kill-rank1-at-batch-N`` exists, rank 1 removes it and kills itself with
    SIGKILL in its N-th training batch: a worker dying at a known step, once. While
    ``record_dir/kill-raylet-at-batch-N`` exists, the first rank of a node other than the head's to
    reach its N-th batch removes it and kills that node's raylet (its parent process) with SIGKILL:
    a node lost at a known step, once. While ``record_dir/sleep-per-batch`` exists, every training
    batch sleeps the seconds it holds: steps slow enough for the driver to act between two checkpoints.
    While ``record_dir/slow-rank-R`` exists, rank R sleeps the seconds it holds on top: a straggler.
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
            for pause in (Path(self.record_dir, "sleep-per-batch"),
                          Path(self.record_dir, f"slow-rank-{os.environ.get('RANK', '0')}")):
                if pause.exists():
                    time.sleep(float(pause.read_text()))
        return self.mlp(x)

    def _maybe_die(self) -> None:
        self._maybe_kill_raylet()
        if os.environ.get("RANK") != "1":
            return
        for marker in Path(self.record_dir).glob("kill-rank1-at-batch-*"):
            if int(marker.name.rsplit("-", 1)[1]) == self.batches:
                marker.unlink()
                os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_kill_raylet(self) -> None:
        marker = Path(self.record_dir, f"kill-raylet-at-batch-{self.batches}")
        if not marker.exists():
            return
        raylet = os.getppid()
        command = Path(f"/proc/{raylet}/cmdline").read_bytes().split(b"\0")
        if not command[0].endswith(b"raylet") or b"--head" in command:
            return
        try:
            marker.unlink()  # one rank of the node takes the node down
        except FileNotFoundError:
            return
        # As a machine that goes away: the raylet and every process it started (workers, agents) at once.
        children = [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                    if _parent_of(stat) == raylet]
        os.kill(raylet, signal.SIGKILL)
        for pid in children:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def _parent_of(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class RowBlobs(torch.utils.data.Dataset):
    """Gaussian blobs of ``classes`` classes whose samples carry their own index (``row``), for
    :class:`RowRecorder` to record."""

    def __init__(self, samples: int, features: int = 8, classes: int = 4):
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(0, classes, (samples,), generator=g)
        centres = torch.randn(classes, features, generator=g) * 3
        self.x = centres[self.labels] + torch.randn(samples, features, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "row": torch.tensor(i), "labels": self.labels[i]}
