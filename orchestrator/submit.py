"""`orch submit`, `orch jobs`, `orch logs`, `orch stop`: runs as Ray Jobs on a remote cluster.

`orch submit` runs the same `orch train` (or `orch tune`) on the cluster's head node through
Ray's Jobs API (``ray.job_submission.JobSubmissionClient``), so the run no longer depends on the
laptop that started it. The job's runtime environment ships the user's working directory (their
model, objective and data code, a ``--config-dir`` inside it), extra pip packages and environment
variables; the nodes need only `orch` installed. Before anything is submitted the plan is checked
here against the live cluster's nodes, read through Ray's state API at the same address, and
the settings that cannot work from a job are refused: a tracking store or checkpoint directory
given as a path relative to this machine.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import RunConfig, SubmitConfig
from plans.cluster_facts import NodeFacts
from plans.errors import OrchError, PlanError, Violation
from plans.spec import Accelerator, ClusterSpec, ResumeMode

GIB = 1024**3
JOB_ADDRESS_ENV = "RAY_ADDRESS"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
EXIT_OF_STATUS = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 143}
"""`orch submit --wait`: the exit code of each final job status (STOPPED as a SIGTERM would)."""


class JobError(OrchError):
    """The Ray Jobs server refused a request or cannot be reached."""


def jobs_address(cfg: RunConfig) -> str:
    """The Ray Jobs address: ``cluster.address`` when it is an http(s) URL, else ``RAY_ADDRESS``."""
    address = cfg.cluster.address or ""
    if address.startswith(("http://", "https://")):
        return address
    env = os.environ.get(JOB_ADDRESS_ENV, "")
    if env.startswith(("http://", "https://")):
        return env
    raise PlanError([Violation("cluster.address", cfg.cluster.address,
                               "orch submit needs the Ray Jobs address of the cluster's head (its dashboard).",
                               "set cluster.address=http://HEAD:8265, or RAY_ADDRESS=http://HEAD:8265")])


def submit_violations(cfg: RunConfig) -> list[Violation]:
    """What cannot work from a job that runs on another machine: every path must name storage
    the cluster reaches, not this machine's working directory."""
    found = []
    uri = cfg.tracking.uri
    if cfg.tracking.enabled and not _reachable_from_a_job(uri):
        found.append(Violation("tracking.uri", uri,
                               "is a store relative to this machine's working directory; the job runs on the "
                               "cluster's head node and would track there, out of your reach.",
                               "set tracking.uri to an MLflow server (http://host:5000) or an absolute path "
                               "on storage the head node shares (sqlite:////shared/mlflow.db)"))
    uses_checkpoints = cfg.train.checkpoint_every > 0 or cfg.train.resume == ResumeMode.auto
    if uses_checkpoints and not _is_absolute_location(cfg.train.checkpoint_dir):
        found.append(Violation("train.checkpoint_dir", cfg.train.checkpoint_dir,
                               "is relative: a submitted job's checkpoints must be on storage every node shares.",
                               "set train.checkpoint_dir to an absolute path on shared storage "
                               "(or a URI such as s3://bucket/run)"))
    return found


def _reachable_from_a_job(uri: str) -> bool:
    if uri.startswith(("http://", "https://", "databricks")):
        return True
    if uri.startswith("sqlite:///"):
        return uri.startswith("sqlite:////")
    if uri.startswith("file://"):
        return uri.startswith("file:///")
    return os.path.isabs(uri)


def _is_absolute_location(path: str) -> bool:
    return "://" in path or os.path.isabs(path)


def live_nodes(address: str, cluster: ClusterSpec) -> list[NodeFacts]:
    """The alive nodes at the Jobs address, through Ray's state API (no driver connection).

    Its node table has CPUs, GPUs and Ray's schedulable memory; that memory (most of a node's at
    its start) stands for the host memory, and GPU memory, which the table does not hold, stays
    as declared (``cluster.device_memory_gib``).
    """
    from ray.util.state import list_nodes

    try:
        nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], detail=True,
                           raise_on_missing_output=False)
    except Exception as error:  # noqa: BLE001 - Ray raises several types for an unreachable address
        raise JobError(f"cluster.address={address}: cannot read the cluster's nodes ({type(error).__name__}: "
                       f"{error}). Fix: start the cluster's head with its dashboard (`ray start --head "
                       "--include-dashboard=true`) and give its address") from None
    gpu_memory = int(cluster.device_memory_gib * GIB) if cluster.accelerator == Accelerator.gpu else None
    facts = []
    for node in nodes:
        resources = node.resources_total or {}
        facts.append(NodeFacts(node_id=node.node_id, address=node.node_ip, cpus=float(resources.get("CPU", 0)),
                               gpus=float(resources.get("GPU", 0)), host_memory_bytes=int(resources.get("memory", 0)),
                               gpu_memory_bytes=gpu_memory))
    return facts


@dataclass(frozen=True)
class Submission:
    """What goes to the Jobs API."""

    entrypoint: str
    runtime_env: dict
    metadata: dict


def submission(command: str, overrides: list[str], submit: SubmitConfig, config_dir: str | None,
               cwd: Path) -> Submission:
    """The job for ``orch <command> <overrides>``: run on the head node against the cluster it is
    on (``cluster.address=auto``), in the shipped working directory."""
    working_dir = Path(submit.working_dir or cwd).resolve()
    arguments = [o for o in overrides if not o.startswith("cluster.address=")] + ["cluster.address=auto"]
    if config_dir is not None:
        resolved = (cwd / config_dir).resolve()
        if not resolved.is_relative_to(working_dir):
            raise PlanError([Violation("--config-dir", config_dir,
                                       f"is outside the working directory shipped to the cluster ({working_dir}).",
                                       "move the config directory into it, or set submit.working_dir to a "
                                       "directory holding both")])
        arguments = ["--config-dir", str(resolved.relative_to(working_dir)), *arguments]
    runtime_env: dict = {"working_dir": str(working_dir), "excludes": list(submit.excludes)}
    if submit.pip:
        runtime_env["pip"] = list(submit.pip)
    if submit.env:
        runtime_env["env_vars"] = {str(k): str(v) for k, v in submit.env.items()}
    entrypoint = shlex.join(["orch", command, *arguments])
    return Submission(entrypoint=entrypoint, runtime_env=runtime_env, metadata={"orch.command": command})


def client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as error:  # noqa: BLE001 - connection and version errors alike
        raise JobError(f"cluster.address={address}: no Ray Jobs server answers there ({type(error).__name__}: "
                       f"{error}). Fix: give the head's dashboard address (http://HEAD:8265)") from None


def submit(address: str, job: Submission) -> str:
    """Submit; the job's id (Ray's submission id)."""
    jobs = client(address)
    try:
        return jobs.submit_job(entrypoint=job.entrypoint, runtime_env=job.runtime_env, metadata=job.metadata)
    except Exception as error:  # noqa: BLE001 - the server's refusal, as its message
        raise JobError(f"the Ray Jobs server at {address} refused the job: {error}") from None


def follow(address: str, job_id: str, out=sys.stdout) -> str:
    """Print the job's output as it comes until it ends; its final status."""
    jobs = client(address)

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    return wait(address, job_id, timeout_s=60)


def wait(address: str, job_id: str, timeout_s: float) -> str:
    """Poll until the job is in a final status (or ``timeout_s`` passes); that status."""
    jobs = client(address)
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(jobs.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(1.0)


def jobs_table(address: str) -> str:
    """`orch jobs`: every job of the cluster, newest first."""
    rows = [("job id", "status", "started", "entrypoint")]
    for job in sorted(client(address).list_jobs(), key=lambda j: j.start_time or 0, reverse=True):
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000)) if job.start_time else "-"
        entry = job.entrypoint if len(job.entrypoint) <= 80 else job.entrypoint[:77] + "..."
        rows.append((job.submission_id or job.job_id or "-", str(job.status.value), started, entry))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def logs(address: str, job_id: str) -> str:
    try:
        return client(address).get_job_logs(job_id)
    except Exception as error:  # noqa: BLE001 - an unknown id is a RuntimeError with the server's message
        raise JobError(f"no logs for job {job_id!r} at {address}: {error}") from None


def stop(address: str, job_id: str) -> str:
    """Ask Ray to stop the job (SIGTERM to its `orch`, which ends its MLflow run KILLED and its
    workers), then wait for its final status."""
    try:
        client(address).stop_job(job_id)
    except Exception as error:  # noqa: BLE001 - an unknown id is a RuntimeError with the server's message
        raise JobError(f"cannot stop job {job_id!r} at {address}: {error}") from None
    return wait(address, job_id, timeout_s=120)
