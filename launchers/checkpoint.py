"""Published checkpoints: a checkpoint counts only once every rank has written it.

DeepSpeed writes each checkpoint into its own tag directory. Only after all ranks have
finished (a barrier) does rank 0 record the tag in ``latest.json``, written to a temporary
file and renamed over the old one, which is atomic on POSIX. A crash in the middle of a save
leaves the previous ``latest.json`` pointing at the previous, complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plans.errors import OrchError

LATEST = "latest.json"
UNIVERSAL_SUFFIX = "_universal"
"""A published tag's universal conversion lives next to it, as ``<tag>_universal``."""
_TAG = re.compile(r"step_[0-9]{9}")
_RUN_ID = re.compile(r"[A-Za-z0-9][\w\-]{0,255}")
"""MLflow's own rule for run ids (``mlflow.utils.validation``): no separators, no dots."""


class CheckpointRecordError(OrchError):
    """``latest.json`` names something this orchestrator never writes (e.g. a path outside its directory)."""


@dataclass(frozen=True)
class Published:
    """The newest complete checkpoint of a run."""

    tag: str
    step: int
    run_id: str | None
    tags: list[str] = field(default_factory=list)
    """Every kept tag, oldest first."""
    layout: dict[str, int] | None = None
    """The plan that wrote it (dp, tp, pp, zero_stage, micro_batch_size, grad_accum_steps): a resume
    with another dp goes through a universal checkpoint (:mod:`launchers.universal`)."""


def tag_for(step: int) -> str:
    """A tag is derived from the step alone, so no user input ever becomes a path."""
    return f"step_{step:09d}"


def latest(checkpoint_dir: str | os.PathLike) -> Published | None:
    path = Path(checkpoint_dir) / LATEST
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    layout = data.get("layout")
    record = Published(tag=data["tag"], step=int(data["step"]), run_id=data.get("run_id"), tags=list(data["tags"]),
                       layout={k: int(v) for k, v in layout.items()} if isinstance(layout, dict) else None)
    _check_record(record, path)
    return record


def _check_record(record: Published, path: Path) -> None:
    """Refuse a record whose names could leave the checkpoint directory.

    Tags become paths that are loaded and, when pruned, deleted; the run id selects the MLflow
    run to continue. Only names :func:`tag_for` and MLflow produce are accepted, so an edited
    or planted ``latest.json`` cannot point a resume, or a prune, at another directory.
    """
    for tag in [record.tag, *record.tags]:
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise CheckpointRecordError(
                f"{path}: tag={tag!r} is not a checkpoint tag this orchestrator writes ({tag_for(0)} and so on); "
                "it could name a path outside train.checkpoint_dir. Fix: delete the file to start fresh, or point "
                "train.checkpoint_dir at a directory this orchestrator wrote")
    if record.run_id is not None and not (isinstance(record.run_id, str) and _RUN_ID.fullmatch(record.run_id)):
        raise CheckpointRecordError(
            f"{path}: run_id={record.run_id!r} is not an MLflow run id. Fix: delete the file to start fresh, or "
            "point train.checkpoint_dir at a directory this orchestrator wrote")


def publish(checkpoint_dir: str | os.PathLike, step: int, run_id: str | None, keep: int,
            layout: dict[str, int] | None = None) -> Published:
    """Record ``step``'s checkpoint as the latest and delete the ones beyond ``keep`` (and any
    universal conversion made from them)."""
    root = Path(checkpoint_dir)
    previous = latest(root)
    tag = tag_for(step)
    tags = [t for t in (previous.tags if previous else []) if t != tag] + [tag]
    kept, dropped = tags[-max(keep, 1):], tags[:-max(keep, 1)]
    record = Published(tag=tag, step=step, run_id=run_id, tags=kept, layout=layout)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".latest-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({**asdict(record), "published_at": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    for old in dropped:
        shutil.rmtree(root / old, ignore_errors=True)
        shutil.rmtree(root / f"{old}{UNIVERSAL_SUFFIX}", ignore_errors=True)
    return record
