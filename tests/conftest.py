"""Shared fixtures: the real composed config (shrunk for CPU), a module-scoped Ray, MLflow stores."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from orchestrator.config import register_configs

REPO = Path(__file__).resolve().parents[1]
# Small enough that a 2-worker run takes seconds on 2 cores, big enough for the loss to fall.
FAST = ["train.steps=30", "train.log_every=5", "train.eval_batches=2", "plan.micro_batch_size=4"]


_REFERENCE: dict = {}


def dp_reference():
    """The data-parallel run other layouts are compared with: dp=2, micro-batch 4, ZeRO-1, ``FAST``.

    Trained once per session (in the Ray of the first test that asks) and shared: tp, pp and
    universal-checkpoint tests all follow this curve, each to its own justified tolerance.
    """
    if "run" not in _REFERENCE:
        import tempfile

        from orchestrator.config import to_typed
        from orchestrator.driver import run_training

        store = tempfile.mkdtemp(prefix="orch-dp-reference-")
        cfg = compose_config(*FAST, f"tracking.uri=sqlite:///{store}/mlflow.db", "plan.dp=2", "plan.zero_stage=1")
        _REFERENCE["run"] = run_training(*to_typed(cfg))
    return _REFERENCE["run"]


def lm_inputs(seq_len: int):
    """What the planner measures a language model with: windows of ``seq_len`` byte tokens and
    next-token cross-entropy (the default data source and objective)."""
    from plans.workload import Workload
    from workloads.corpus import CorpusSource
    from workloads.objectives import CausalLM

    return Workload(model_factory=lambda: None, objective=CausalLM(), data=CorpusSource(seq_len=seq_len))


def compose_config(*overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_module("conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_store():
    """A real S3-compatible server on loopback (moto in server mode) with an empty bucket, and the
    standard AWS variables that reach it (``env``), as a cluster's nodes would hold them."""
    import secrets
    import shutil
    import subprocess
    import sys
    import time

    import boto3

    port = free_port()
    server = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "orch-test",
           "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16), "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="orch")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        yield {"env": env, "bucket": "orch", "client": client}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local_ray():
    """One embedded Ray for a test module (starting Ray costs ~4 s); 2 CPUs like this machine, on
    loopback as `orch` starts it."""
    start_test_ray()
    yield
    ray.shutdown()


def start_test_ray(num_cpus: int = 2) -> None:
    from launchers.ray_session import start_local_ray

    start_local_ray(num_cpus=num_cpus, object_store_memory=300 * 1024**2,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}})


@pytest.fixture
def sqlite_uri(tmp_path, monkeypatch) -> str:
    """A fresh local MLflow store; the test runs in tmp_path so artifacts land there too."""
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


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
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
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
