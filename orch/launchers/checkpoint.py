"""Published checkpoints: a checkpoint counts only once every rank has written it.

DeepSpeed writes each checkpoint into its own tag directory. Only after all ranks have
finished (a barrier) does rank 0 record the tag in ``latest.json``, written to a temporary
file and renamed over the old one, which is atomic on POSIX. A crash in the middle of a save
leaves the previous ``latest.json`` pointing at the previous, complete checkpoint. Before
``latest.json``, rank 0 writes the tag's manifest (:mod:`orch.launchers.manifest`): the digests of its
files and what it was written for, which a resume checks before anything is loaded
(:func:`resumable`), falling back to the newest intact kept tag.

One run at a time writes a checkpoint directory: :func:`directory_lock`.

On object storage (:mod:`orch.launchers.storage`) the order is the same: every node uploads its files,
then rank 0 writes the manifest from the digests the nodes took, then ``latest.json``
(:func:`publish_remote`); an object is replaced whole, as ``os.replace`` replaces a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from orch.launchers.manifest import (
    MANIFEST,
    CheckpointIntegrityError,
    Manifest,
    manifest_text,
    missing_manifest,
    parse_manifest,
    verify_listing,
    write_manifest,
)
from orch.launchers.manifest import verify as verify_manifest
from orch.launchers.storage import RemoteDir
from orch.plans.errors import OrchError, PlanError, Violation, first_line
from orch.plans.storage.locations import is_remote, local_path, write_whole

LATEST = "latest.json"
LOCK = ".orch.lock"
UNIVERSAL_SUFFIX = "_universal"
"""A published tag's universal conversion lives next to it, as ``<tag>_universal``."""
_TAG = re.compile(r"step_[0-9]{9}")
_RUN_ID = re.compile(r"[A-Za-z0-9][\w\-]{0,255}")
"""MLflow's own rule for run ids (``mlflow.utils.validation``): no separators, no dots."""


class CheckpointRecordError(OrchError):
    """``latest.json`` is malformed or names something this orchestrator never writes (e.g. a path
    outside its directory)."""


class CheckpointDirError(OrchError):
    """``train.checkpoint_dir`` cannot be created or written."""


class CheckpointDirBusyError(CheckpointDirError):
    """Another run holds the checkpoint directory."""


class NoIntactCheckpointError(OrchError):
    """``train.resume=auto`` found published checkpoints, none of which verifies."""


@dataclass(frozen=True)
class Published:
    """The newest complete checkpoint of a run."""

    tag: str
    step: int
    run_id: str | None
    tags: list[str] = field(default_factory=list)
    """Every kept tag, oldest first."""
    layout: dict[str, int | str] | None = None
    """The plan that wrote it (dp, tp, pp, zero_stage, micro_batch_size, grad_accum_steps): a resume
    with another dp goes through a universal checkpoint (:mod:`orch.launchers.engines.deepspeed.universal`)."""


def tag_for(step: int) -> str:
    """A tag is derived from the step alone, so no user input ever becomes a path."""
    return f"step_{step:09d}"


def latest(checkpoint_dir: str | os.PathLike) -> Published | None:
    """The record ``latest.json`` holds, or None without one; :class:`CheckpointRecordError` if malformed."""
    if is_remote(checkpoint_dir):
        where = f"{str(checkpoint_dir).rstrip('/')}/{LATEST}"
        text = _read_remote(checkpoint_dir, lambda store: store.read_text(LATEST))
        if text is None:
            return None
    else:
        path = Path(local_path(checkpoint_dir)) / LATEST
        if not path.exists():
            return None
        where = str(path)
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            text = ""
    record = _parse_record(text, where)
    _check_record(record, where)
    return record


def _parse_record(text: str, where: str) -> Published:
    """``latest.json``'s text read into a :class:`Published`, every field's type checked."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON object was expected, not {type(data).__name__}")
        layout = data.get("layout")
        if not (isinstance(data["step"], int) and isinstance(data["tags"], list)
                and (layout is None or isinstance(layout, dict))):
            raise TypeError("step must be an integer, tags a list, layout an object")
        return Published(tag=data["tag"], step=data["step"], run_id=data.get("run_id"), tags=list(data["tags"]),
                         layout={k: _layout_value(k, v) for k, v in layout.items()} if layout else None)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        what = f"missing key {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise CheckpointRecordError(
            f"{where} is malformed ({what}); it is the record of the latest checkpoint and this orchestrator writes "
            "it whole. Fix: delete it to start fresh (or set train.resume=never), or point train.checkpoint_dir at a "
            "directory this orchestrator wrote") from None


def _layout_value(key: str, value) -> int | str:
    """A layout entry: the engine's name (a ``plan.engine`` value), else a whole number."""
    if key == "engine":
        return str(value)
    return int(value)


def _check_record(record: Published, path: str) -> None:
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
            layout: dict[str, int] | None = None, model: dict | None = None) -> Published:
    """Write ``step``'s manifest (every rank has finished writing), record it as the latest and
    delete the ones beyond ``keep`` (and any universal conversion made from them).

    ``model`` is the :func:`model_signature` of the model that wrote it."""
    root = Path(local_path(checkpoint_dir))
    previous = latest(root)  # a malformed or planted record stops the save before anything is deleted
    tag = tag_for(step)
    write_manifest(root / tag, layout=layout, model=model)
    # A conversion of an earlier checkpoint under this tag (a run resumed from an older one
    # writes the same steps again) would otherwise be taken for this one's.
    shutil.rmtree(root / f"{tag}{UNIVERSAL_SUFFIX}", ignore_errors=True)
    record, dropped = _next_record(previous, step, run_id, keep, layout)
    write_whole(root / LATEST, _record_text(record))
    for old in dropped:
        shutil.rmtree(root / old, ignore_errors=True)
        shutil.rmtree(root / f"{old}{UNIVERSAL_SUFFIX}", ignore_errors=True)
    return record


def publish_remote(uri: str, step: int, run_id: str | None, keep: int, files: dict[str, str],
                   sizes: dict[str, int], layout: dict[str, int] | None = None,
                   model: dict | None = None) -> Published:
    """:func:`publish` for a checkpoint directory on object storage, once every node has uploaded
    its files: ``files`` and ``sizes`` are their digests and sizes, taken where they were written.

    The same order keeps the same guarantee: the manifest is written after every file, and
    ``latest.json`` (one object, replaced whole) after the manifest."""
    store = RemoteDir(uri)
    previous = latest(uri)
    tag = tag_for(step)
    store.write_text(f"{tag}/{MANIFEST}", manifest_text(files, sizes, layout, model))
    store.delete(f"{tag}{UNIVERSAL_SUFFIX}")
    record, dropped = _next_record(previous, step, run_id, keep, layout)
    store.write_text(LATEST, _record_text(record))
    for old in dropped:
        store.delete(old)
        store.delete(f"{old}{UNIVERSAL_SUFFIX}")
    return record


def download_verified(uri: str, tag: str, folder: str | os.PathLike) -> None:
    """Download the remote ``tag`` into ``folder`` and check every file against its manifest.

    A copy that fails (cut short, or a file changed or added in the store) is removed: nothing
    unverified stays on the node for a later load to pick up.
    """
    try:
        RemoteDir(uri).download(tag, folder)
        verify_manifest(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _next_record(previous: Published | None, step: int, run_id: str | None, keep: int,
                 layout: dict[str, int] | None) -> tuple[Published, list[str]]:
    """The record naming ``step`` the latest, and the tags it no longer keeps."""
    tag = tag_for(step)
    tags = [t for t in (previous.tags if previous else []) if t != tag] + [tag]
    kept, dropped = tags[-max(keep, 1):], tags[:-max(keep, 1)]
    return Published(tag=tag, step=step, run_id=run_id, tags=kept, layout=layout), dropped


def _record_text(record: Published) -> str:
    return json.dumps({**asdict(record), "published_at": time.time()})


def model_signature(module, config: dict) -> dict:
    """What a checkpoint records of its model: every parameter's name and shape, and the config
    the model was built from (to name the field whose change makes a checkpoint incompatible)."""
    params = {name: list(p.shape) for name, p in module.named_parameters()}
    return {"config": json.loads(json.dumps(dict(config), default=str)), "params": params}


def resumable(checkpoint_dir: str | os.PathLike, model: dict | None,
              warn: TextIO | None = None) -> Published | None:
    """The newest kept checkpoint that verifies against its manifest, checked against ``model``.

    A tag that fails verification (cut short, altered, missing its manifest) is skipped, saying
    so on ``warn``, for the next older one. The first intact one must fit ``model`` (its
    :func:`model_signature`): a PlanError names the changed ``model.*`` field otherwise, since
    every older tag of the directory would have been written by the same model. None when
    nothing was published; :class:`NoIntactCheckpointError` when nothing verifies.
    """
    record = latest(checkpoint_dir)
    if record is None:
        return None
    warn = warn or sys.stderr
    where = str(checkpoint_dir).rstrip("/") if is_remote(checkpoint_dir) else Path(local_path(checkpoint_dir))
    refused = []
    for tag in reversed(record.tags or [record.tag]):
        try:
            manifest = _verified(checkpoint_dir, tag)
        except CheckpointIntegrityError as error:
            refused.append(str(error).split(" Fix:")[0])
            print(f"warning: not resuming from {where}/{tag}: {refused[-1]}", file=warn, flush=True)
            continue
        _check_model(f"{where}/{tag}", manifest.model, model)
        if refused:
            print(f"warning: resuming from the newest intact checkpoint, {where}/{tag}", file=warn, flush=True)
        layout = {k: _layout_value(k, v) for k, v in manifest.layout.items()} if manifest.layout else None
        return dataclasses.replace(record, tag=tag, step=int(tag.removeprefix("step_")), layout=layout)
    raise NoIntactCheckpointError(
        f"train.resume=auto: no checkpoint kept in train.checkpoint_dir={where} verifies ({'; '.join(refused)}). "
        "Fix: set train.resume=never to start fresh, or point train.checkpoint_dir at intact checkpoints")


def _verified(checkpoint_dir: str | os.PathLike, tag: str) -> Manifest:
    """A local tag verified byte for byte; a remote one by its objects' names and sizes (its
    digests are checked on the nodes that download it, before anything is loaded)."""
    if not is_remote(checkpoint_dir):
        return verify_manifest(Path(local_path(checkpoint_dir)) / tag)
    where = f"{str(checkpoint_dir).rstrip('/')}/{tag}"
    text = _read_remote(checkpoint_dir, lambda store: store.read_text(f"{tag}/{MANIFEST}"))
    if text is None:
        raise missing_manifest(where)
    manifest = parse_manifest(text, where)
    verify_listing(manifest, _read_remote(checkpoint_dir, lambda store: store.sizes(tag)), where)
    return manifest


def _read_remote(checkpoint_dir: str | os.PathLike, read):
    """``read(store)`` of the checkpoint directory's store, given up after ``cluster.connect_timeout_s``
    (:func:`orch.plans.storage.locations.bounded`) with an error naming train.checkpoint_dir and the setting.

    A store that answered the first check can still stall on a later read (the pointer, a
    manifest, a listing): pyarrow's S3 client ignores its request timeout on Linux, and a read
    held open kept `orch train` and `orch export` waiting for minutes, deaf to Ctrl-C, before a raw
    ``OSError``. The wait here ends at the limit, and at once on Ctrl-C or SIGTERM.
    """
    from orch.plans.storage.locations import StorageTimeout, bounded, probe_limit_s

    try:
        return bounded(lambda: read(RemoteDir(str(checkpoint_dir), timeout_s=probe_limit_s())))
    except StorageTimeout as error:
        raise PlanError([Violation("train.checkpoint_dir", str(checkpoint_dir),
                                   "a read of its checkpoint records " + error.reason(), error.fix())]) from None
    except OSError as error:
        what = first_line(error, 200) or type(error).__name__
        raise PlanError([Violation("train.checkpoint_dir", str(checkpoint_dir),
                                   f"reading its checkpoint records failed ({what}).",
                                   "check the store's endpoint and credentials, or train.resume=never to start "
                                   "fresh")]) from None


def _check_model(folder: str, saved: dict | None, now: dict | None) -> None:
    """Refuse a checkpoint whose parameters' names or shapes differ from the model's."""
    if not saved or not now or saved.get("params") == now.get("params"):
        return
    old_cfg, new_cfg = saved.get("config") or {}, now.get("config") or {}
    changed = sorted(k for k in set(old_cfg) | set(new_cfg) if old_cfg.get(k) != new_cfg.get(k))
    difference = _first_param_difference(saved.get("params") or {}, now.get("params") or {})
    why = (f"the checkpoint {folder} was written by a model whose parameters differ from this one's "
           f"({difference}): it cannot be loaded into it.")
    if not changed:
        raise PlanError([Violation("model", new_cfg.get("_target_"), why,
                                   "resume with the model that wrote it, or set train.resume=never (or another "
                                   "train.checkpoint_dir) to start fresh")])
    raise PlanError([Violation(f"model.{key}", new_cfg.get(key), f"{why} It was written with model.{key}="
                               f"{old_cfg.get(key)!r}.", f"set model.{key}={old_cfg.get(key)!r}, or "
                               "train.resume=never (or another train.checkpoint_dir) to start fresh")
                     for key in changed])


def _first_param_difference(saved: dict, now: dict) -> str:
    for name in sorted(set(saved) | set(now)):
        if saved.get(name) != now.get(name):
            return f"{name}: checkpoint {saved.get(name)}, model {now.get(name)}"
    return "none"


@contextlib.contextmanager
def directory_lock(checkpoint_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``checkpoint_dir`` for one run: an exclusive ``flock`` on a file inside it.

    Two runs writing one directory would interleave their tags and each overwrite the other's
    ``latest.json``. The kernel releases the lock when the process ends, however it ends, so a
    crashed run never leaves the directory locked. (``flock`` on NFS is emulated with POSIX
    locks by Linux clients, which the server enforces across nodes.) Object stores have no such
    lock: a remote directory is not held, and two runs must not be given the same one.
    """
    if is_remote(checkpoint_dir):
        yield
        return
    root = Path(local_path(checkpoint_dir))
    path = root / LOCK
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise CheckpointDirError(
            f"train.checkpoint_dir={checkpoint_dir} cannot be used: {error.strerror} ({error.filename}). Fix: point "
            "train.checkpoint_dir at a directory this user can create and write") from None
    try:
        _take(fd, checkpoint_dir, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _take(fd: int, checkpoint_dir: str | os.PathLike, path: Path) -> None:
    """Lock ``fd`` (the lock file at ``path``) for this process, or raise :class:`CheckpointDirBusyError`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        raise CheckpointDirBusyError(
            f"train.checkpoint_dir={checkpoint_dir} is in use by another orch run (pid {holder}, holding {path}). "
            "Fix: give this run another train.checkpoint_dir, or wait for the other run to end") from None


def refuse_held_or_malformed(checkpoint_dir: str | os.PathLike) -> None:
    """Raise now what :func:`directory_lock` and :func:`latest` would refuse of a local ``checkpoint_dir``
    (another run holds it; its ``latest.json`` is malformed), creating and keeping nothing.

    `orch train` asks before it imports torch or starts Ray, so those refusals take a second or two
    instead of the whole start-up; the run still takes the lock itself later, which is what
    counts. A remote directory's record is read later, within the storage checks' time limit.
    """
    if is_remote(checkpoint_dir):
        return
    path = Path(local_path(checkpoint_dir)) / LOCK
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        pass  # no lock file (nothing ever held it), or one this user cannot open: the lock itself says which
    else:
        try:
            _take(fd, checkpoint_dir, path)  # released at once, by the close
        finally:
            os.close(fd)
    latest(checkpoint_dir)


def layout_of(plan) -> dict[str, int | str]:
    """What a checkpoint records of the plan that wrote it."""
    return {"engine": plan.engine, "dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "zero_stage": plan.zero_stage,
            "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps}


def resumed_position(position: int, saved: dict[str, int], micro_batch_size: int, dp: int) -> int:
    """The batch position in the current epoch a rank continues from after a change of layout.

    Every rank reads its own stride of one shuffled order (DistributedSampler), so after
    ``position`` batches of ``micro x dp`` samples the whole layout has consumed the order's first
    ``position * micro * dp`` samples; the new layout continues after the same ones (rounded
    down to a whole batch: a few samples may be read twice, none skipped).
    """
    consumed = position * saved["micro_batch_size"] * saved["dp"]
    return consumed // (micro_batch_size * dp)
