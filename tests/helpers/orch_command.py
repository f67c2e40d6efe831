"""`python -m orch ARGS` as the tests run it: in a child forked from a process that has already
imported torch and orch (:mod:`helpers.orch_zygote`), one per pytest process, instead of a fresh
interpreter that spends seconds of CPU importing them for each command.

:func:`orch_run` answers as :func:`subprocess.run` does and :func:`orch_popen` as
:class:`subprocess.Popen`; the command is the same real process either way (its pid, exit code,
signals, streams, working directory and environment are its own). Tests of what happens while orch
is imported (start-up order, a user's folders named like orch's packages, ``-X importtime``) start
a fresh interpreter with :mod:`subprocess`, ``[sys.executable, "-m", "orch", ...]``, as do the
README's verbatim runs.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers.processes import worker_env

ZYGOTE = Path(__file__).with_name("orch_zygote.py")
START_TIMEOUT_S = 180.0

_zygote: dict = {}


def _socket_path() -> str:
    """The zygote of this pytest process, started at its first use."""
    proc = _zygote.get("proc")
    if proc is not None and proc.poll() is None:
        return _zygote["path"]
    folder = tempfile.mkdtemp(prefix="orch-zygote-")
    path = os.path.join(folder, "socket")
    log = open(os.path.join(folder, "zygote.log"), "wb")  # noqa: SIM115 - held for the zygote's life
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=log, env=worker_env(), cwd=folder)
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while not line.startswith(b"ready") and time.monotonic() < deadline and proc.poll() is None:
        if selector.select(timeout=1.0):
            line = proc.stdout.readline()
    if not line.startswith(b"ready"):
        proc.kill()
        raise RuntimeError(f"the orch zygote did not start: see {folder}/zygote.log")
    _zygote.update(proc=proc, path=path)
    atexit.register(_stop, proc, folder)
    return path


def _stop(proc: subprocess.Popen, folder: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    shutil.rmtree(folder, ignore_errors=True)


def _stream(spec, default_fd: int) -> tuple[int, object | None, bool]:
    """(fd to send, the file the test reads or None, whether the fd is ours to close once sent)."""
    if spec is None:
        return default_fd, None, False
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        return write, read, True
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None, True
    if isinstance(spec, int):
        return spec, None, False
    return spec.fileno(), None, False


class OrchProcess:
    """The running command, as much of :class:`subprocess.Popen` as the tests use."""

    def __init__(self, args: list[str], *, cwd, env: dict[str, str] | None = None, stdin=None,
                 stdout=None, stderr=None, text: bool = False, start_new_session: bool = False):
        self.args = ["orch", *args]
        self.returncode: int | None = None
        env = worker_env() if env is None else env
        in_fd, in_read, in_ours = _stream(subprocess.DEVNULL if stdin is None else stdin, 0)
        out_fd, out_read, out_ours = _stream(stdout, 1)
        if stderr == subprocess.STDOUT:
            err_fd, err_read, err_ours = out_fd, None, False
        else:
            err_fd, err_read, err_ours = _stream(stderr, 2)
        if in_read is not None:  # a pipe into the command: the test writes to it
            in_read, in_fd = in_fd, in_read
        request = {"args": [str(a) for a in args], "cwd": str(Path(cwd or os.getcwd()).resolve()), "env": env,
                   "new_session": start_new_session}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(_socket_path())
            socket.send_fds(self._conn, [json.dumps(request).encode()], [in_fd, out_fd, err_fd])
            self.pid = json.loads(self._conn.recv(4096))["pid"]
        finally:
            for fd, ours in ((in_fd, in_ours), (out_fd, out_ours), (err_fd, err_ours)):
                if ours:
                    os.close(fd)

        def wrap(fd, mode):
            if fd is None:
                return None
            raw = os.fdopen(fd, mode + "b", buffering=0 if mode == "w" else -1)
            return io.TextIOWrapper(raw, write_through=True) if text else raw

        self.stdin = wrap(in_read, "w")
        self.stdout = wrap(out_read, "r")
        self.stderr = wrap(err_read, "r")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._read_status()
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._conn.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._read_status()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _read_status(self) -> None:
        message = self._conn.recv(4096)
        self.returncode = json.loads(message)["returncode"] if message else -signal.SIGKILL
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | bytes | None = None, timeout: float | None = None):
        """Both outputs read to their end (and ``input`` written), then the exit awaited."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = {self.stdout: [], self.stderr: []}
        selector = selectors.DefaultSelector()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                selector.register(stream.fileno(), selectors.EVENT_READ, stream)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in selector.select(timeout=left):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.data].append(data)
                else:
                    selector.unregister(key.fd)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.1))

        def joined(stream):
            if stream is None:
                return None
            data = b"".join(chunks[stream])
            stream.close()
            return data.decode(errors="replace") if isinstance(stream, io.TextIOWrapper) else data

        return joined(self.stdout), joined(self.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        self.wait()


def orch_popen(args: list[str], **kwargs) -> OrchProcess:
    """`python -m orch *args`, started; keyword arguments as :class:`subprocess.Popen`'s."""
    return OrchProcess(list(args), **kwargs)


def orch_run(args: list[str], *, cwd, env: dict[str, str] | None = None, timeout: float | None = None,
             capture_output: bool = True, text: bool = True, input: str | None = None,
             start_new_session: bool = False) -> subprocess.CompletedProcess:
    """`python -m orch *args` to its end, as :func:`subprocess.run` answers; killed at ``timeout``."""
    pipe = subprocess.PIPE if capture_output else None
    proc = OrchProcess(list(args), cwd=cwd, env=env, text=text, stdin=subprocess.PIPE if input is not None else None,
                       stdout=pipe, stderr=pipe, start_new_session=start_new_session)
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
