"""The link between a rank's training thread and the driver that polls it.

Training runs on a thread of its own so that the actor keeps answering polls while a step runs.
Polling works through every way of reaching Ray, Ray Client (``ray://``) included, which
streaming generators do not, and a poll that stops being answered tells the driver the process
is gone.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from orch.launchers.job import PollStatus, StepReport


class DriverLink:
    """What the driver reads of one rank: its reports, its progress, how its training ended."""

    def __init__(self):
        self.reports: list[StepReport] = []
        self.progress_step = 0
        """The last optimizer step this rank finished (read by the driver's hang detection)."""
        self.milestones = 0
        """Forward, backward and step calls finished: when every rank stalls, the ones with
        the fewest are where the others wait for them."""
        self.progress_at = time.monotonic()
        self.done = False
        self.error: str | None = None
        self.sampler = None
        self._sampling = False

    def sample_system(self, interval_s: float) -> None:
        """Sample this node's hardware every ``interval_s`` once training has begun."""
        from orch.launchers.system_metrics import SystemSampler

        self.sampler = SystemSampler(interval_s)

    def milestone(self) -> None:
        self.milestones += 1

    def stepped(self, step: int) -> None:
        """Optimizer step ``step`` finished on this rank."""
        self.progress_step = step
        self.progress_at = time.monotonic()
        if self.sampler is not None and not self._sampling:
            # Sampling begins once training has: the MLflow import it needs would otherwise
            # hold up the first step, competing for this rank's CPU and interpreter lock.
            self._sampling = True
            self.sampler.start()

    def run(self, train: Callable[[], Iterator[StepReport]], device: Any, name: str) -> None:
        """Run ``train`` on a thread of its own, collecting its reports, and return at once."""
        self.progress_at = time.monotonic()

        def run() -> None:
            try:
                if device is not None and getattr(device, "type", "cpu") == "cuda":
                    import torch

                    torch.cuda.set_device(device)  # the current device is per thread
                for report in train():
                    self.reports.append(report)  # list.append is atomic under the GIL
                if self.sampler is not None:
                    # Before done: the poll that tells the driver this rank is done carries it.
                    self.sampler.finish()
            except BaseException:  # reported to the driver through poll(), never swallowed
                self.error = traceback.format_exc()
            finally:
                self.done = True

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def poll(self, seen: int) -> PollStatus:
        """This rank's reports after the first ``seen`` and the state of its training."""
        # Done first: a report the training thread appends after this read comes with the next
        # poll, where reading the reports first could miss the last one of a rank that is done.
        done, error = self.done, self.error
        return PollStatus(reports=self.reports[seen:], done=done, error=error, step=self.progress_step,
                          milestones=self.milestones, since_progress_s=time.monotonic() - self.progress_at,
                          system=self.sampler.take() if self.sampler is not None else [])

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def thread_stacks() -> str:
    """Every thread's Python stack, answered even while the training thread is stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
