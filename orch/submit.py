"""`orch submit`, `orch jobs`, `orch logs`, `orch stop`: runs as Ray Jobs on a remote cluster.

`orch submit` runs the same `orch train` (or `orch tune`) on the cluster's head node through
Ray's Jobs API (``ray.job_submission.JobSubmissionClient``), so the run no longer depends on the
laptop that started it. The job's runtime environment ships the user's working directory (their
model, objective and data code, a ``--config-dir`` inside it), extra pip packages and environment
variables; the nodes need only `orch` installed. Before anything is submitted the plan is checked
here against the live cluster's nodes, read through Ray's state API at the same address, and
the settings that cannot work from a job are refused: a tracking store or checkpoint directory
given as a path relative to this machine.

Credentials never travel with a job. Ray keeps a job's command line (its entrypoint) and runtime
environment in its job table, which the dashboard, `ray job list` and the head's logs show to
anyone who can reach the cluster; so an override, a ``submit.env`` variable or a config file
that would carry a password or token into the job is refused, and the job reads its credentials
from the cluster's own environment. What is printed here names addresses without their userinfo.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orch.config import RunConfig, SubmitConfig
from orch.credentials import (
    CLUSTER_CREDENTIALS_FIX,
    PASSWORD_ENV,
    USERNAME_ENV,
    redact_text,
    redact_uri,
    secret_overrides,
)
from orch.launchers.passthrough import credential_word
from orch.plans.cluster_facts import NodeFacts
from orch.plans.errors import OrchError, PlanError, Violation
from orch.plans.spec import Accelerator, ClusterSpec, ResumeMode

GIB = 1024**3
JOB_ADDRESS_ENV = "RAY_ADDRESS"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
EXIT_OF_STATUS = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 143}
"""`orch submit --wait`: the exit code of each final job status (STOPPED as a SIGTERM would)."""
# Overrides that set the Jobs address: `cluster.address=`, `+cluster.address=`, `++cluster.address=`.
_ADDRESS_KEYS = ("cluster.address", "+cluster.address", "++cluster.address")
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
"""MLflow's bearer token, the third credential its REST client reads from the environment."""
_CLUSTER_CREDENTIALS = CLUSTER_CREDENTIALS_FIX


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
    shown = redact_uri(cfg.cluster.address) if cfg.cluster.address else cfg.cluster.address
    raise PlanError([Violation("cluster.address", shown,
                               "orch submit needs the Ray Jobs address of the cluster's head (its dashboard).",
                               "set cluster.address=http://HEAD:8265, or RAY_ADDRESS=http://HEAD:8265")])


def submit_violations(cfg: RunConfig, command: str = "train") -> list[Violation]:
    """What cannot work from a job that runs on another machine: every path must name storage
    the cluster reaches, not this machine's working directory (nor the job's: Ray unpacks the
    shipped directory into a package cache on the head, which later jobs of the same package share)."""
    found = []
    if command == "tune" and not _is_absolute_location(cfg.tune.out or ""):
        found.append(Violation("tune.out", cfg.tune.out,
                               "a submitted tune writes its plan file on the cluster's head node, inside the job's "
                               "copy of the working directory (Ray's package cache): out of your reach, and seen by "
                               "later jobs shipped from the same directory.",
                               "set tune.out to a URI (s3://bucket/plans/plan/tuned.yaml) or an absolute path on "
                               "storage you share with the head node (/shared/plans/plan/tuned.yaml)"))
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


def shipped_credentials(overrides: list[str], env: dict[str, str], tracking_uri: str = "") -> list[Violation]:
    """Credentials a job would carry to the cluster, where anyone who can list its jobs reads them.

    ``overrides`` become the job's command line (``cluster.address`` excepted: the job gets
    ``auto``), refused by a key named like a credential (:func:`orch.credentials.secret_overrides`,
    whatever route it takes: ``hydra.job.env_set.*``, ``submit.env.*``, ``+any.api_key``) or by a
    ``user:password@`` in the value; ``env`` its environment, refused by name
    (:func:`orch.launchers.passthrough.credential_word`, the test of the variables never passed to
    workers) or by a ``user:password@`` in the value; ``tracking_uri`` is the URI as the config was composed
    (unresolved, before its credentials were moved out), so a user:password@ there that no
    override wrote comes from a config file shipped in the working directory. The value of a
    variable is never part of the message.
    """
    found: dict[str, Violation] = {}
    for name, word in secret_overrides(overrides):
        found[name] = Violation(
            name, "(not shown)", f"its name holds {word}: it looks like a credential, which would be shipped in the "
            "job's command line: Ray shows it to anyone who can list the cluster's jobs.",
            f"remove {name} and {_CLUSTER_CREDENTIALS}")
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in _ADDRESS_KEYS or redact_text(value) == value:
            continue
        name = key.lstrip("+")
        found.setdefault(name, Violation(
            name, redact_text(value), "holds a user:password@, which would be shipped in the job's command line: Ray "
            "shows it to anyone who can list the cluster's jobs (dashboard, `ray job list`, the head's logs).",
            f"give {name} without the user:password@ and {_CLUSTER_CREDENTIALS}"))
    if redact_text(tracking_uri) != tracking_uri and "tracking.uri" not in found:
        found["tracking.uri"] = Violation(
            "tracking.uri", redact_text(tracking_uri), "holds a user:password@ from a config file, which would be "
            "shipped to the cluster with the working directory.",
            f"remove the user:password@ from the file and {_CLUSTER_CREDENTIALS}")
    for name, value in env.items():
        word = credential_word(str(name))
        if word is not None:
            why = f"its name holds {word}: it looks like a credential"
        elif redact_text(str(value)) != str(value):
            why = "its value holds a user:password@"
        else:
            continue
        found[f"submit.env.{name}"] = Violation(
            "submit.env", str(name), f"{why}, and Ray keeps a job's environment in its job table, readable by anyone "
            "who can list the cluster's jobs.", f"remove {name} from submit.env and {_CLUSTER_CREDENTIALS}")
    return list(found.values())


def check_tracking(cfg: RunConfig) -> list[str]:
    """`orch train`'s check of the tracking server, made here before anything is submitted; the
    lines to print about it (a note or a warning).

    A server that refuses this machine's credentials, or is no MLflow server, is an error as in
    `orch train`. A server that does not answer here is a warning only: it may be one only the
    cluster reaches (a dashboard reached through a port forward). Credentials from here are never
    sent with the job, so whenever the server wants some the note says where the job finds them.
    """
    from orch.tracking.store import TrackingError, TrackingUnreachable, check_reachable

    uri = cfg.tracking.uri
    if not cfg.tracking.enabled or not uri.startswith(("http://", "https://")):
        return []
    local = [name for name in (USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV) if os.environ.get(name)]
    shown = f"tracking.uri={redact_uri(uri)}"
    from_cluster = (f"the job uses {USERNAME_ENV} / {PASSWORD_ENV} (or {TOKEN_ENV}) from the cluster's own "
                    "environment (where `ray start` runs on the head node, or your secrets mechanism)")
    try:
        check_reachable(uri, timeout_s=cfg.cluster.connect_timeout_s)
    except TrackingUnreachable as error:
        return [f"warning: {_without_fix(error)}; not checked from here: the job checks it on the cluster before "
                "it trains (the cluster may reach a server this machine does not)"]
    except TrackingError as error:
        if "(HTTP 401)" not in str(error):  # not MLflow, no permission: as `orch train` says it
            raise
        if local:  # the credentials here are wrong; the job would not get them anyway
            raise TrackingError(f"{_without_fix(error)}. Fix: correct or unset {' and '.join(local)} here (they "
                                "only check the server: the job uses the cluster's own)") from None
        return [f"note: {shown} needs credentials (HTTP 401) and a submitted job takes none from here: "
                f"{from_cluster}; without them there it fails with HTTP 401"]
    if local:
        return [f"note: {' / '.join(local)} checked {shown} from here but are not sent with the job (Ray shows a "
                f"job's command and environment to anyone who can list the cluster's jobs): {from_cluster}"]
    return []


def _without_fix(error: Exception) -> str:
    """The error's message without its fix, for a message that gives its own."""
    return str(error).split(" Fix:")[0].rstrip(".")


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
        raise JobError(redact_text(
            f"cluster.address={address}: cannot read the cluster's nodes ({type(error).__name__}: {error}). Fix: "
            "start the cluster's head with its dashboard (`ray start --head --include-dashboard=true`) and give "
            "its address")) from None
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
    on (``cluster.address=auto``), in the shipped working directory. Overrides or variables that
    would carry credentials into the job are refused (:func:`shipped_credentials`)."""
    shipped = shipped_credentials(overrides, dict(submit.env))
    if shipped:
        raise PlanError(shipped)
    working_dir = Path(submit.working_dir or cwd).resolve()
    arguments = [o for o in overrides if o.partition("=")[0] not in _ADDRESS_KEYS] + ["cluster.address=auto"]
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


def submitted_message(job_id: str, address: str, entrypoint: str, address_given: bool) -> str:
    """What `orch submit` prints once the job is in: its id and command, and how to follow it.

    ``address_given``: the address came from ``cluster.address`` (not ``RAY_ADDRESS``), so the
    follow-up commands repeat it, without the user:password@ it may hold.
    """
    shown = redact_uri(address)
    follow_up = f" cluster.address={shown}" if address_given else ""
    lines = [f"submitted job {job_id} to {shown}: {redact_text(entrypoint)}",
             f"  follow it: orch logs {job_id} --follow{follow_up}",
             f"  stop it:   orch stop {job_id}{follow_up}",
             f"  all jobs:  orch jobs{follow_up}"]
    if address_given and shown != address:
        lines.append("  (cluster.address is shown without its user:password@: give it as you did here)")
    return "\n".join(lines)


def client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as error:  # noqa: BLE001 - connection and version errors alike
        raise JobError(redact_text(
            f"cluster.address={address}: no Ray Jobs server answers there ({type(error).__name__}: {error}). Fix: "
            "give the head's dashboard address (http://HEAD:8265)")) from None


def submit(address: str, job: Submission) -> str:
    """Submit; the job's id (Ray's submission id)."""
    jobs = client(address)
    try:
        return jobs.submit_job(entrypoint=job.entrypoint, runtime_env=job.runtime_env, metadata=job.metadata)
    except Exception as error:  # noqa: BLE001 - the server's refusal, as its message
        raise JobError(redact_text(f"the Ray Jobs server at {address} refused the job: {error}")) from None


def follow(address: str, job_id: str, out=sys.stdout) -> str:
    """Print the job's output as it comes until it ends, URI credentials redacted; its final status."""
    jobs = client(address)
    try:  # an unknown id is refused as `orch logs` without --follow refuses it, not as a crash
        jobs.get_job_status(job_id)
    except Exception as error:  # noqa: BLE001 - an unknown id is a RuntimeError with the server's message
        raise JobError(redact_text(f"no job {job_id!r} at {address}: {error}")) from None

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            out.write(redact_text(lines))
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
    """`orch jobs`: every job of the cluster, newest first; a URI's user:password@ in an entrypoint
    (a job submitted by other means) is not shown."""
    rows = [("job id", "status", "started", "entrypoint")]
    for job in sorted(client(address).list_jobs(), key=lambda j: j.start_time or 0, reverse=True):
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000)) if job.start_time else "-"
        entrypoint = redact_text(job.entrypoint)
        entry = entrypoint if len(entrypoint) <= 80 else entrypoint[:77] + "..."
        rows.append((job.submission_id or job.job_id or "-", str(job.status.value), started, entry))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def logs(address: str, job_id: str) -> str:
    """The job's output so far, URI credentials redacted."""
    try:
        return redact_text(client(address).get_job_logs(job_id))
    except Exception as error:  # noqa: BLE001 - an unknown id is a RuntimeError with the server's message
        raise JobError(redact_text(f"no logs for job {job_id!r} at {address}: {error}")) from None


def stop(address: str, job_id: str) -> str:
    """Ask Ray to stop the job (SIGTERM to its `orch`, which ends its MLflow run KILLED and its
    workers), then wait for its final status."""
    try:
        client(address).stop_job(job_id)
    except Exception as error:  # noqa: BLE001 - an unknown id is a RuntimeError with the server's message
        raise JobError(redact_text(f"cannot stop job {job_id!r} at {address}: {error}")) from None
    return wait(address, job_id, timeout_s=120)
