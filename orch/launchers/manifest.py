"""A checkpoint's manifest: the SHA-256 of every file of its tag directory, written last.

Rank 0 writes ``manifest.json`` into the tag directory once every rank has finished writing
(after the save's barrier), to a temporary file renamed into place, and only then publishes the
tag in ``latest.json``. Before anything of a checkpoint is loaded, the files are compared with
it: a truncated file, a file swapped in from another checkpoint, a file added or missing, or a
tag without a manifest is refused, naming the file. The manifest also records what the
checkpoint was written for (the plan's layout, the model's parameter shapes and config), so a
resume can refuse an incompatible checkpoint before any worker starts.

The digests catch corruption and mix-ups; they do not authenticate the checkpoint (whoever can
write the directory can rewrite the manifest). Code in a pickle is stopped by the weights-only
loader (:mod:`orch.launchers.safe_load`), which every load goes through as well.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from orch.plans.errors import OrchError
from orch.plans.storage.locations import partial_name, write_whole

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 1 << 20


class CheckpointIntegrityError(OrchError):
    """A checkpoint's files do not match its manifest (or it has none): nothing of it was loaded."""


@dataclass(frozen=True)
class Manifest:
    """What a tag directory held when it was written."""

    folder: Path
    files: dict[str, str]
    """Path relative to the tag directory → SHA-256 hex digest."""
    layout: dict[str, int | str] | None = None
    model: dict | None = None
    """``{"config": {...}, "params": {name: shape}}`` of the model that wrote it (see
    :func:`orch.launchers.checkpoint.model_signature`)."""
    sizes: dict[str, int | str] | None = None
    """Path → size in bytes: what a remote copy is checked against without downloading it."""

    def digest_of(self, path: str | os.PathLike) -> str:
        """The recorded digest of ``path`` (absolute or relative to the folder); refuses unlisted files."""
        relative = _relative(self.folder, path)
        if relative is None or relative not in self.files:
            raise CheckpointIntegrityError(
                f"checkpoint file {path} is not listed in {self.folder / MANIFEST}: it was not written with this "
                f"checkpoint and was not loaded. {_FIX}")
        return self.files[relative]


_FIX = ("Fix: resume only from checkpoints this orchestrator wrote (another kept tag is used when one is intact), "
        "or set train.resume=never to start fresh")


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(folder: str | os.PathLike) -> tuple[dict[str, str], dict[str, int]]:
    """Every file under ``folder`` (relative path) → its SHA-256, and → its size."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointIntegrityError(f"checkpoint directory {root} does not exist; nothing to publish")
    names = _listed_files(root)
    return {name: sha256_of(root / name) for name in names}, {name: (root / name).stat().st_size for name in names}


def manifest_text(files: dict[str, str], sizes: dict[str, int], layout: dict[str, int | str] | None = None,
                  model: dict | None = None) -> str:
    """The manifest's JSON, for a checkpoint whose files were digested where they were written."""
    return json.dumps({"format": _FORMAT, "files": files, "sizes": sizes, "layout": layout, "model": model})


def write_manifest(folder: str | os.PathLike, layout: dict[str, int | str] | None = None,
                   model: dict | None = None) -> Manifest:
    """Digest every file under ``folder`` and write the manifest whole
    (:func:`orch.plans.storage.locations.write_whole`)."""
    root = Path(folder)
    files, sizes = file_digests(root)
    write_whole(root / MANIFEST, manifest_text(files, sizes, layout, model))
    return Manifest(folder=root, files=files, layout=layout, model=model, sizes=sizes)


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of ``folder``, structure checked; its files are not digested here."""
    root = Path(folder)
    path = root / MANIFEST
    if not path.is_file():
        raise missing_manifest(root)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        text = ""
    return parse_manifest(text, root)


def missing_manifest(where) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"checkpoint {where} has no {MANIFEST}: it was not completely written by this orchestrator (or was "
        f"written before checkpoints carried manifests), so it cannot be verified and was not loaded. {_FIX}")


def parse_manifest(text: str, folder: str | os.PathLike) -> Manifest:
    """The manifest ``text`` of the checkpoint at ``folder`` (a path, or a URI for a remote one),
    structure checked."""
    try:
        data = json.loads(text)
        files, sizes = data["files"], data.get("sizes")
        layout, model = data.get("layout"), data.get("model")
        well_formed = (data.get("format") == _FORMAT and isinstance(files, dict)
                       and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
                       and (sizes is None or (isinstance(sizes, dict) and set(sizes) == set(files)
                                              and all(isinstance(v, int) for v in sizes.values())))
                       and (layout is None or isinstance(layout, dict)) and (model is None or isinstance(model, dict)))
    except (ValueError, KeyError, TypeError, AttributeError):
        well_formed = False
    if not well_formed:
        raise CheckpointIntegrityError(f"{folder}/{MANIFEST} is not a manifest this orchestrator writes (malformed). "
                                       f"{_FIX}")
    return Manifest(folder=Path(folder), files=files, layout=layout, model=model, sizes=sizes)


def verify_listing(manifest: Manifest, present: dict[str, int], where: str) -> None:
    """Refuse a remote copy whose objects (path → size) are not exactly the manifest's files at their
    recorded sizes: a cut-short upload or a changed object, found without downloading anything. The
    digests are checked where the files are downloaded (:func:`verify`)."""
    for name in sorted(set(present) - set(manifest.files) - {MANIFEST}):
        raise CheckpointIntegrityError(f"checkpoint object {where}/{name} is not listed in its {MANIFEST}: it was "
                                       f"added after the checkpoint was written. {_FIX}")
    for name in sorted(manifest.files):
        if name not in present:
            raise CheckpointIntegrityError(f"checkpoint object {where}/{name} listed in its {MANIFEST} is missing. "
                                           f"{_FIX}")
        if manifest.sizes is not None and present[name] != manifest.sizes[name]:
            raise CheckpointIntegrityError(
                f"checkpoint object {where}/{name} holds {present[name]} bytes, its {MANIFEST} records "
                f"{manifest.sizes[name]} (cut short or changed); it was not loaded. {_FIX}")


def verify(folder: str | os.PathLike) -> Manifest:
    """Refuse ``folder`` unless its files are exactly those of its manifest, byte for byte."""
    manifest = read_manifest(folder)
    root = manifest.folder
    present = set(_listed_files(root))
    for name in sorted(present - set(manifest.files)):
        raise CheckpointIntegrityError(
            f"checkpoint file {root / name} is not listed in {root / MANIFEST}: it was added after the checkpoint "
            f"was written. {_FIX}")
    for name in sorted(manifest.files):
        if name not in present:
            raise CheckpointIntegrityError(f"checkpoint file {root / name} listed in {root / MANIFEST} is missing. "
                                           f"{_FIX}")
        if sha256_of(root / name) != manifest.files[name]:
            raise CheckpointIntegrityError(
                f"checkpoint file {root / name} does not match its digest in {root / MANIFEST} (truncated, changed or "
                f"swapped with another checkpoint's file); it was not loaded. {_FIX}")
    return manifest


def _listed_files(root: Path) -> list[str]:
    """Every entry under ``root`` a load could read, relative; refuses links and special files.

    A symbolic link could make a digested name read other bytes later, so it is refused
    rather than followed. The manifest and the temporary files of a write in progress are not
    part of the checkpoint.
    """
    names = []
    being_written = partial_name(root / MANIFEST)
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise CheckpointIntegrityError(f"checkpoint entry {path} is a link or special file; checkpoints this "
                                           f"orchestrator writes hold regular files only. {_FIX}")
        if path.is_dir() or relative == MANIFEST or (path.parent == root and path.name.startswith(being_written)):
            continue
        names.append(relative)
    return names


def _relative(root: Path, path: str | os.PathLike) -> str | None:
    """``path`` (absolute, or relative to the working directory as DeepSpeed passes it) relative to
    ``root``, both resolved; None when it lies outside."""
    try:
        return Path(os.path.realpath(path)).relative_to(os.path.realpath(root)).as_posix()
    except ValueError:
        return None
