"""Storage locations opened within a time limit: the checks of every declared path or URI.

A data source (``data=ray`` in ``orch/workloads/``), the checkpoint store (``orch/launchers/storage.py``)
and ``tune.out`` all open their locations through ``pyarrow.fs`` before any worker starts, and a
store that never answers (GCS retries for about 15 minutes with no network) must end in an error
naming ``cluster.connect_timeout_s``, not a hang that ignores Ctrl-C. This is the one place that
bounds those checks, below both layers that use it; pyarrow is imported only when a store is opened.

pyarrow's own limits are set first (GCS ``retry_limit_seconds``, S3 connect and request
timeouts), and the call runs in a daemon thread the command stops waiting for at the deadline
(:func:`bounded`), so Ctrl-C ends the wait at once. ``file://`` URIs are plain local paths
(:func:`local_path`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TypeVar

from orch.plans.spec import ClusterSpec

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
    except BaseException:  # Ctrl-C or SIGTERM (orch.signals) while waiting
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


def unwritable_reason(directory: Path) -> str | None:
    """Why this process cannot create files in ``directory`` (creating it and its parents where
    missing), or None.

    Its closest existing parent must be a directory this process can create a file in. That is
    tried, with a temporary file removed at once, rather than read off the permission bits: root
    passes every permission check, yet a read-only mount or a file system such as ``/proc`` takes
    no new files from it either.
    """
    existing = next((p for p in [directory, *directory.absolute().parents] if p.exists()), None)
    where = str(existing) if existing == directory else f"its closest existing parent {existing}"
    if existing is None or not existing.is_dir():
        return f"{where} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"{where} is a directory this user cannot create files in ({error.strerror or error})"
    return None


def partial_name(path: Path) -> str:
    """The prefix of :func:`write_whole`'s temporary files for ``path``: a listing that must not count
    a write in progress (a checkpoint's manifest) skips names that start with it."""
    return f".{path.name}."


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, creating missing parent directories.

    It goes to a temporary file beside ``path`` (named by :func:`partial_name`), flushed to the disk
    and renamed over it once written: a reader, or a later run after a crash or a power loss, finds
    the old file or the new one, never a part. Raises :class:`OSError` when it cannot, leaving no
    temporary file behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=partial_name(path), suffix=".partial")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
