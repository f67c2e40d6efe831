"""Published checkpoints: a checkpoint counts only once every rank has written it.

DeepSpeed writes each checkpoint into its own tag directory. Only after all ranks have
finished (a barrier) does rank 0 record the tag in ``latest.json``, written to a temporary
file and renamed over the old one, which is atomic on POSIX. A crash in the middle of a save
leaves the previous ``latest.json`` pointing at the previous, complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LATEST = "latest.json"


@dataclass(frozen=True)
class Published:
    """The newest complete checkpoint of a run."""

    tag: str
    step: int
    run_id: str | None
    tags: list[str] = field(default_factory=list)
    """Every kept tag, oldest first."""


def tag_for(step: int) -> str:
    """A tag is derived from the step alone, so no user input ever becomes a path."""
    return f"step_{step:09d}"


def latest(checkpoint_dir: str | os.PathLike) -> Published | None:
    path = Path(checkpoint_dir) / LATEST
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Published(tag=data["tag"], step=int(data["step"]), run_id=data.get("run_id"), tags=list(data["tags"]))


def publish(checkpoint_dir: str | os.PathLike, step: int, run_id: str | None, keep: int) -> Published:
    """Record ``step``'s checkpoint as the latest and delete the ones beyond ``keep``."""
    root = Path(checkpoint_dir)
    previous = latest(root)
    tag = tag_for(step)
    tags = [t for t in (previous.tags if previous else []) if t != tag] + [tag]
    kept, dropped = tags[-max(keep, 1):], tags[:-max(keep, 1)]
    record = Published(tag=tag, step=step, run_id=run_id, tags=kept)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".latest-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({**asdict(record), "published_at": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    for old in dropped:
        shutil.rmtree(root / old, ignore_errors=True)
    return record
