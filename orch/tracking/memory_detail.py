"""What was alive at the memory probe's peak (``train.memory_probe_detail``), into the run and onto
the screen.

No MLflow here: a run without tracking still prints the largest holders of its peak.
"""

from __future__ import annotations

import re

from orch.plans.memory.build import format_bytes

FOLDER = "memory/at_peak"
ARTIFACT = FOLDER + "/rank{rank}.json"
SHOWN = 6
"""Holders printed for the rank with the largest peak; the artifact has them all."""


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def across_layers(held: list[dict]) -> list[dict]:
    """``held`` with the entries of repeated layers summed (``blocks.3.mlp`` and ``blocks.7.mlp`` as
    ``blocks.*.mlp``), largest first: what a deep model's peak is made of, in a few lines."""
    grouped: dict[str, dict] = {}
    for entry in held:
        what = _LAYER_INDEX.sub(".*", entry["what"])
        into = grouped.setdefault(what, {"what": what, "bytes": 0, "storages": 0})
        into["bytes"] += entry["bytes"]
        into["storages"] += entry["storages"]
    return sorted(grouped.values(), key=lambda entry: -entry["bytes"])


def holder_lines(held: list[dict], indent: str) -> list[str]:
    """The largest holders of one rank's peak, repeated layers summed, one line each."""
    lines = []
    for entry in across_layers(held)[:SHOWN]:
        count = f"{entry['storages']} tensors" if entry["storages"] > 1 else "1 tensor"
        lines.append(f"{indent}{format_bytes(entry['bytes']):>12}  {entry['what']} ({count})")
    return lines


def record_memory_at_peak(tracker, reports: list, out) -> None:
    """Each rank's holders of its measured peak as ``memory/at_peak/rank<r>.json``, and those of
    the rank with the largest peak printed, largest first, repeated layers summed."""
    detailed = [r for r in reports if r.memory_at_peak is not None]
    if not detailed:
        return
    top = max(detailed, key=lambda r: r.measured_peak_bytes or 0)
    print(f"memory at the measured peak of rank {top.rank} ({format_bytes(top.measured_peak_bytes or 0)}), "
          "largest first:", file=out, flush=True)
    for line in holder_lines(top.memory_at_peak, "  "):
        print(line, file=out, flush=True)
    if tracker is None:
        return
    for report in detailed:
        tracker.log_dict({"rank": report.rank, "measured_peak_bytes": report.measured_peak_bytes,
                          "at_peak": report.memory_at_peak}, ARTIFACT.format(rank=report.rank))
    print(f"memory: every rank's holders of its peak in the MLflow run under {FOLDER}/",
          file=out, flush=True)
