"""Checkpoints on object storage: ``train.checkpoint_dir`` as a URI (``s3://``, ``gs://``, ``hdfs://``).

DeepSpeed writes and reads a checkpoint as files of a local directory, so a URI is used the way
Ray Train uses its ``storage_path``: each node's workers write into a local staging directory and
the node's first worker uploads what they wrote; a resume downloads the tag into the staging
directory and loads it from there. The stores are reached through ``pyarrow.fs``, which reads
the endpoint and the credentials the way each store's own tools do (for S3: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, a profile or an instance
role). Nothing here holds a credential, and a URI that carries one is refused
(:func:`location_violation`).

Every check that opens a store (:func:`location_violation`, :func:`bounded` around a read) waits
at most ``cluster.connect_timeout_s`` (:func:`probe_limit`): pyarrow's own limits are set first
(GCS ``retry_limit_seconds``, S3 connect and request timeouts), and the call runs in a daemon
thread the command stops waiting for at the deadline, so a store that never answers (GCS
retries for about 15 minutes with no network) ends in an error, and Ctrl-C ends the wait at once.
Transfers of whole checkpoints are not bounded this way: they take as long as their size needs.

``file://`` URIs are plain local paths (:func:`local_path`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from plans.spec import ClusterSpec
from plans.uris import CREDENTIALS_FIX, carries_credentials

_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_T = TypeVar("_T")

TIMEOUT_FIELD = "cluster.connect_timeout_s"
"""The setting that bounds every storage check, named in the error a timeout gives."""
_probe_limit_s: ContextVar[float] = ContextVar("storage_probe_limit_s", default=ClusterSpec.connect_timeout_s)
STORE_FIX = ("check the scheme (s3://, gs://, hdfs://), the bucket, and the endpoint and credentials in the "
             "environment (for S3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION)")


class StorageTimeout(TimeoutError):
    """A store that did not answer a check within ``seconds``."""

    def __init__(self, seconds: float):
        super().__init__(f"the store did not answer within {TIMEOUT_FIELD}={seconds:g}s")
        self.seconds = seconds

    def reason(self) -> str:
        """The part of a violation that says what happened."""
        return (f"timed out after {self.seconds:g} s ({TIMEOUT_FIELD}): the store did not answer (no network, "
                "a wrong endpoint, or a firewall that drops the connection).")

    def fix(self) -> str:
        return ("check the network, and the endpoint in the environment (for S3: AWS_ENDPOINT_URL; the scheme "
                f"s3://, gs://, hdfs://); raise {TIMEOUT_FIELD} on a slow network")


@contextlib.contextmanager
def probe_limit(seconds: float) -> Iterator[None]:
    """Bound the storage checks the block makes by ``seconds`` (a command's ``cluster.connect_timeout_s``).

    A context rather than an argument because data sources (``data=ray``) open their paths from
    properties the planner reads, which have no room for a setting of the cluster."""
    # A value out of range is reported by the range checks; the checks meanwhile keep the default.
    token = _probe_limit_s.set(seconds if 0 < seconds < math.inf else ClusterSpec.connect_timeout_s)
    try:
        yield
    finally:
        _probe_limit_s.reset(token)


def probe_limit_s() -> float:
    """The current bound of a storage check in seconds (:func:`probe_limit`)."""
    return _probe_limit_s.get()


def bounded(call: Callable[[], _T], seconds: float | None = None) -> _T:
    """``call()``, given up after ``seconds`` (default :func:`probe_limit_s`) with :class:`StorageTimeout`.

    The call runs in a daemon thread while this thread waits on an event: pyarrow holds a thread
    in C++ until its retries end, where a signal handler cannot run, whereas the wait here is
    interrupted by Ctrl-C at once. A thread given up on keeps running until pyarrow returns; being
    a daemon, it does not keep the process alive (a pool's threads would: they are joined at exit),
    and :func:`exit_past_abandoned_checks` ends the process without waiting for it.
    """
    seconds = probe_limit_s() if seconds is None else seconds
    outcome: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised in the waiting thread
            outcome["error"] = error
        finally:
            done.set()

    thread = threading.Thread(target=run, name="orch-storage-check", daemon=True)
    thread.start()
    try:
        finished = done.wait(seconds)
    except BaseException:  # Ctrl-C or SIGTERM (orchestrator.signals) while waiting
        _abandoned.append(thread)
        raise
    if not finished:
        _abandoned.append(thread)
        raise StorageTimeout(seconds)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


_abandoned: list[threading.Thread] = []


def exit_past_abandoned_checks(code: int | str | None) -> None:
    """End the process now with ``code`` (as ``sys.exit`` would) if a check given up on is still waiting on its store.

    pyarrow's exit handler finalizes S3 only once every request in flight has ended, which for a
    store that never answers is after its timeouts and retries; a process that skips it crashes
    at exit. A command whose check was given up on (a timeout, or Ctrl-C) has done its own
    cleanup by the time it returns, so it ends here without the interpreter's exit handlers.
    """
    if not any(thread.is_alive() for thread in _abandoned):
        return
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def open_location(uri: str, timeout_s: float | None = None):
    """``pyarrow.fs.FileSystem.from_uri(uri)``: the store and the path inside it; with ``timeout_s``,
    the store's own limits set to it, so that a check given up on (:func:`bounded`) also ends soon.

    GCS takes its retry limit from the URI (``retry_limit_seconds``, whole seconds); S3 takes
    connect and request timeouts only as arguments, so the store ``from_uri`` configured (region,
    endpoint and credentials from the environment) is made again with them, from the arguments it
    pickles with (``__reduce__``).
    """
    import pyarrow.fs as pafs

    if timeout_s is None:
        return pafs.FileSystem.from_uri(uri)
    match = _SCHEME.match(uri)
    scheme = match.group("scheme").lower() if match else ""
    if scheme in ("gs", "gcs") and "retry_limit_seconds=" not in uri:
        uri += ("&" if "?" in uri else "?") + f"retry_limit_seconds={max(1, math.ceil(timeout_s))}"
    fs, path = pafs.FileSystem.from_uri(uri)
    if fs.type_name == "s3":
        _, (options,) = fs.__reduce__()
        fs = pafs.S3FileSystem(**{**options, "connect_timeout": timeout_s, "request_timeout": timeout_s})
    return fs, path


def is_remote(location: str | os.PathLike) -> bool:
    """Whether ``location`` names object storage rather than a path of this machine."""
    match = _SCHEME.match(str(location))
    return bool(match) and match.group("scheme").lower() != "file"


def local_path(location: str | os.PathLike) -> str:
    """A local location as a path: ``file:///a/b`` → ``/a/b``; a path is returned as it is."""
    text = str(location)
    return text[len("file://"):] if text.lower().startswith("file://") else text


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
        return f"cannot be opened ({type(error).__name__}: {_first_line(error)}). Fix: {STORE_FIX}"
    import pyarrow.fs as pafs

    if not has_bucket:
        return (f"names the bucket {bucket!r}, which does not exist or these credentials cannot see. Fix: create it, "
                "or check the endpoint and credentials in the environment")
    if info.type == pafs.FileType.File:
        return "is an object, not a directory. Fix: point it at a prefix (it is created if missing)"
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


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
