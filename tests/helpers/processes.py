"""Processes and sockets of what a test started: ports, process trees, loopback checks."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from helpers.config import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def dead_port() -> Iterator[int]:
    """A port on which nothing answers while the block runs: bound on every address and never
    listening, so a connection to it is refused and no other process can take it. (A port that
    :func:`free_port` returned may be taken meanwhile, by a Ray that another test starts.)"""
    with socket.socket() as held:
        held.bind(("", 0))
        yield held.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def descendants(root: int) -> set[int]:
    """PIDs of every process below ``root`` (read from /proc, no extra dependency)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            continue
    return alive


def processes_mentioning(text: str) -> set[int]:
    """PIDs whose command line contains ``text`` (e.g. a Ray cluster's own temp dir)."""
    def mentions(pid: str) -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()

    return _pids_where(mentions)


def processes_working_in(directory: str) -> set[int]:
    """PIDs whose working directory is ``directory``: what a command run there started, Ray's
    agents included, whose command lines name nothing but themselves (``ray::DashboardAgent``)."""
    return _pids_where(lambda pid: os.readlink(f"/proc/{pid}/cwd") == directory)


def _pids_where(matches) -> set[int]:
    """PIDs of the other processes for which ``matches(pid)`` holds (one that exits meanwhile does not)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if matches(entry):
                    found.add(int(entry))
            except OSError:
                continue
    return found


def listening_sockets(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket of these processes."""
    import psutil

    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found += [(pid, process.name(), c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (a dual-stack socket on 127.0.0.1)."""
    import ipaddress

    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


RAY_STOP_GRACE_S = 2.0
"""The grace a `ray start` cluster's processes get at a test's teardown: its GCS server and its
autoscaler monitor outlive SIGTERM by more than 15 s (measured), so a longer grace is only waited
out in full; the raylets and workers are gone within it."""


def kill_tree(pids: set[int], grace_s: float = 10.0) -> None:
    """SIGTERM these processes and all below them, then SIGKILL what is left after ``grace_s``."""
    import signal
    import time

    targets = set(pids)
    for pid in pids:
        targets |= descendants(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(targets):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive(targets) and time.monotonic() < deadline:
            time.sleep(0.2)
