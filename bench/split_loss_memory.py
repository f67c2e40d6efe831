"""The vocabulary-parallel loss's memory: torch's ``loss_parallel`` cross-entropy measured by the
process's resident memory on a 2-rank gloo group, against the planner's count of it on ``meta``.

A measurement apart from the worker's tensor tracker (orch/launchers/memory_probe.py), which has
to reach into DTensor's Python op handlers to see what torch's loss handlers allocate inside
themselves: each rank's [tokens, classes / tp] fp32 logits go through forward and backward, once
split (a DTensor, ``Shard(-1)``, inside ``loss_parallel()``) and once as plain local logits through
aten's kernels. With glibc's mmap threshold fixed low (``MALLOC_MMAP_THRESHOLD_``), every tensor
this size is its own mapping, mapped when allocated and unmapped when freed, so the rise of the
peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) over the pass is the peak
of the tensors alive in it.
The planner's figures are what its meta pass counts for the same call (the loss's logits, their
gradient and what the loss holds between), with :func:`orch.plans.parallel.split_loss.split_loss_on_meta`
for the split one. The tensor tracker's view is printed beside them
(tests/test_memory_probe.py checks that it sees the split loss's peak).

    MALLOC_MMAP_THRESHOLD_=65536 python -m bench.split_loss_memory [--markdown bench/results/split_loss_memory.md]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench.harness import header, publish

TOKENS, CLASSES, TP = 1024, 8192, 2
MiB = 2**20


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def resident_peak_mib(step) -> float:
    """How far the resident set's peak rose above where it stood while ``step()`` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) / 1024


def tracked_peak_mib(step) -> float:
    from orch.launchers.memory_probe import PeakMemoryTracker

    with PeakMemoryTracker() as tracker:
        step()
    return (tracker.peak - tracker.baseline) / MiB


def planned_peak_bytes(tokens: int, classes: int, split: bool) -> int:
    """The planner's meta pass over the loss of [tokens, classes] fp32 logits: the peak of live
    bytes from the logits on (tests/test_split_loss.py counts it too)."""
    from orch.plans.memory.activations import _LiveBytes, _MetaRunsAsOn
    from orch.plans.parallel.split_loss import split_loss_on_meta

    logits = torch.empty(tokens, classes, device="meta", requires_grad=True)
    target = torch.zeros(tokens, dtype=torch.long, device="meta")
    live = _LiveBytes([])
    with live, _MetaRunsAsOn(), split_loss_on_meta(split):
        live._see(logits.untyped_storage())
        F.cross_entropy(logits, target).backward()
    return live.peak


def _peak_with_logits(peak, make, step) -> float:
    """``peak`` of ``step`` over logits made before it and counted with it, as the planner counts them."""
    logits = make()
    return peak(lambda: step(logits)) + TOKENS * CLASSES // TP * 4 / MiB


def _rank(rank: int, port: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    torch.manual_seed(0)
    target = torch.randint(0, CLASSES, (TOKENS,))

    def split_step(logits):
        with loss_parallel():
            F.cross_entropy(logits, target).backward()

    def local_step(logits):
        F.cross_entropy(logits, target % (CLASSES // TP)).backward()

    def split_logits():
        return distribute_tensor(torch.randn(TOKENS, CLASSES), mesh, [Shard(1)]).requires_grad_()

    def local_logits():
        return torch.randn(TOKENS, CLASSES // TP).requires_grad_()

    split_step(split_logits())  # warm: the first pass builds DTensor's caches
    local_step(local_logits())
    row = {}
    for name, make, step in (("split", split_logits, split_step), ("local", local_logits, local_step)):
        for how, peak in (("resident", resident_peak_mib), ("tracked", tracked_peak_mib)):
            row[name, how] = _peak_with_logits(peak, make, step)
    # The tracker wraps DTensor's op handlers while it counts; none may stay wrapped after it.
    row["handlers", "left wrapped"] = sum(hasattr(handler, "tracked_by") for handler in
                                          DTensor._op_dispatcher._custom_op_handlers.values())
    if rank == 0:
        results.update(row)
    dist.destroy_process_group()


def measure(port: int) -> dict[tuple[str, str], float]:
    """Peak MiB by (loss: ``split`` or ``local``, measure: ``resident`` or ``tracked``), on rank 0 of
    a 2-rank gloo group rendezvousing on ``port``."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, results), nprocs=TP)
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        parser.error("run with MALLOC_MMAP_THRESHOLD_=65536 set: without it glibc keeps freed tensors' pages "
                     "and the resident set does not follow the tensors")
    measured = measure(29541)
    logits = TOKENS * CLASSES // TP * 4 / MiB
    lines = [*header("The vocabulary-parallel loss's memory on one tensor-parallel rank", sys.argv),
             f"fp32 logits of {TOKENS} tokens x {CLASSES} classes split over tp={TP}: {logits:.0f} MiB per rank. "
             "Peak MiB of forward and backward, the logits included.", "",
             "| loss | resident set (measured) | planner (meta) | error | tensor tracker |",
             "|---|---:|---:|---:|---:|"]
    for name, split, label in (("split", True, "`loss_parallel` over split logits"),
                               ("local", False, "aten's cross-entropy over the same local logits")):
        resident, planned = measured[name, "resident"], planned_peak_bytes(TOKENS, CLASSES // TP, split) / MiB
        lines.append(f"| {label} | {resident:.1f} | {planned:.1f} | {100 * (planned / resident - 1):+.1f}% | "
                     f"{measured[name, 'tracked']:.1f} |")
    publish(lines, args.markdown)


if __name__ == "__main__":
    main()
