"""Checkpoints on object storage: ``train.checkpoint_dir`` as a URI (``s3://``, ``gs://``, ``hdfs://``).

DeepSpeed writes and reads a checkpoint as files of a local directory, so a URI is used the way
Ray Train uses its ``storage_path``: each node's workers write into a local staging directory and
the node's first worker uploads what they wrote; a resume downloads the tag into the staging
directory and loads it from there. The stores are reached through ``pyarrow.fs``, which reads
the endpoint and the credentials the way each store's own tools do (for S3: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, a profile or an instance
role). Nothing here holds a credential, and a URI that carries one is refused
(:func:`location_violation`).

Every check that opens a store (:func:`location_violation`) waits at most
``cluster.connect_timeout_s``, through :mod:`orch.plans.storage.locations` (which also bounds the data
sources' checks). Transfers of whole checkpoints are not bounded this way: they take as long as
their size needs.

``file://`` URIs are plain local paths (:func:`local_path`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from orch.plans.errors import first_line
from orch.plans.storage.locations import STORE_FIX, StorageTimeout, bounded, is_remote, open_location, probe_limit_s
from orch.plans.storage.uris import CREDENTIALS_FIX, carries_credentials


def location_violation(location: str, timeout_s: float | None = None) -> str | None:
    """Why ``location`` cannot hold checkpoints, or None. Opens the store, so a misspelt scheme, a
    missing bucket or refused credentials are reported before any worker starts; within
    ``timeout_s`` (default :func:`probe_limit_s`), so an unreachable store is reported too."""
    if not is_remote(location):
        return None
    if carries_credentials(location):
        return ("carries credentials in the URI, where they would be recorded with the run's config. "
                f"Fix: {CREDENTIALS_FIX}")
    timeout_s = probe_limit_s() if timeout_s is None else timeout_s

    def probe():
        store = RemoteDir(location, timeout_s=timeout_s)
        info = store.fs.get_file_info(store.root)
        bucket = store.root.split("/", 1)[0]
        has_bucket = store.fs.type_name not in ("s3", "gcs") or store.fs.get_file_info(bucket).type.name != "NotFound"
        return info, bucket, has_bucket

    try:
        info, bucket, has_bucket = bounded(probe, timeout_s)
    except StorageTimeout as error:
        return f"{error.reason()} Fix: {error.fix()}"
    except Exception as error:  # noqa: BLE001 - pyarrow raises OSError, ValueError or ArrowException subclasses
        return f"cannot be opened ({type(error).__name__}: {first_line(error)}). Fix: {STORE_FIX}"
    import pyarrow.fs as pafs

    if not has_bucket:
        return (f"names the bucket {bucket!r}, which does not exist or these credentials cannot see. Fix: create it, "
                "or check the endpoint and credentials in the environment")
    if info.type == pafs.FileType.File:
        return "is an object, not a directory. Fix: point it at a prefix (it is created if missing)"
    return None


@dataclass(frozen=True)
class RemoteDir:
    """A directory of an object store, given by its URI; every name below is relative to it."""

    uri: str
    timeout_s: float | None = None
    """The store's own time limits (:func:`open_location`) for a check; None for transfers of
    whole checkpoints, which take as long as their size needs."""

    @cached_property
    def _opened(self):
        return open_location(self.uri.rstrip("/"), self.timeout_s)

    @property
    def fs(self):
        return self._opened[0]

    @property
    def root(self) -> str:
        return self._opened[1].rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def read_text(self, name: str) -> str | None:
        """The object's text, or None when it does not exist."""
        import pyarrow.fs as pafs

        path = self._path(name)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as stream:
            return stream.read().decode()

    def write_text(self, name: str, text: str) -> None:
        """Write one object. An object store makes it visible whole or not at all, so this is the
        atomic replace a local ``latest.json`` gets from ``os.replace``."""
        with self.fs.open_output_stream(self._path(name)) as stream:
            stream.write(text.encode())

    def sizes(self, name: str) -> dict[str, int]:
        """Every object under ``name``: its path relative to ``name`` → its size in bytes."""
        import pyarrow.fs as pafs

        base = self._path(name)
        found = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {info.path[len(base) + 1:]: info.size for info in found if info.type == pafs.FileType.File}

    def upload(self, local_dir: str | os.PathLike, name: str) -> None:
        """Copy the local directory's files under ``name`` (objects already there are overwritten)."""
        import pyarrow.fs as pafs

        pafs.copy_files(str(local_dir), self._path(name), source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def download(self, name: str, local_dir: str | os.PathLike) -> None:
        """Replace ``local_dir`` with a copy of the objects under ``name``."""
        import pyarrow.fs as pafs

        shutil.rmtree(local_dir, ignore_errors=True)
        Path(local_dir).mkdir(parents=True)
        pafs.copy_files(self._path(name), str(local_dir), source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())

    def delete(self, name: str) -> None:
        """Delete everything under ``name``; nothing to delete is not an error."""
        import pyarrow.fs as pafs

        path = self._path(name)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            self.fs.delete_dir(path)


class StagingDirError(PermissionError):
    """The staging directory exists but is not this user's private directory."""


def staging_dir(location: str, node: str) -> Path:
    """This node's local copy of a remote checkpoint directory.

    Under this user's private staging directory (:func:`private_staging_root`), keyed by the
    location and the node, so two runs with different locations, or two Ray nodes sharing one
    machine, never write into each other's staging directories. Every local rank computes the
    same path, which is why it is not a random ``mkdtemp`` name.
    """
    key = hashlib.sha256(location.encode()).hexdigest()[:16]
    return private_staging_root() / key / node


def private_staging_root() -> Path:
    """``$TMPDIR/orch-staging-<uid>`` (TMPDIR where the node's Ray was started), created mode 0700.

    Staged files are loaded after their digests are checked: a directory another user could
    write would let them swap a file between the check and the load, and one they could read
    would hand them the weights. A path that exists already is used only if it is a real
    directory (not a link) owned by this user that no one else can enter.
    """
    root = Path(tempfile.gettempdir()) / f"orch-staging-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        what = ("a directory" if stat.S_ISDIR(info.st_mode) else "not a directory (a link or a file)")
        raise StagingDirError(
            f"the staging directory for remote checkpoints {root} is {what} owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):04o}; it must be this user's (uid {os.getuid()}) with mode 0700, or others "
            f"could read or replace the checkpoint files staged there. Fix: remove {root} (it is created again), "
            "or start the node's Ray with TMPDIR pointing at a private directory")
    return root
