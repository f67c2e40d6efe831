"""Which of the driver's environment variables the workers inherit.

NCCL, CUDA and the network transports beneath them (UCX, libfabric) are tuned through
environment variables a cluster's administrators set where the job is launched; Ray actors do
not inherit the driver's environment, so without this the workers would run with the defaults.
``CUDA_VISIBLE_DEVICES`` is excluded: each node's workers get their own (:mod:`launchers.devices`).
The object store's endpoint and region (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``) go along, so
workers write checkpoints to the store the driver checked (:mod:`launchers.storage`).
Names that look like credentials are never passed this way, whatever their prefix: a node reads
its own (its environment, a profile, an instance role).
"""

from __future__ import annotations

from collections.abc import Mapping

PASSED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_", "UCX_", "FI_", "AWS_")
NEVER_PASSED = frozenset({"CUDA_VISIBLE_DEVICES"})
CREDENTIAL_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
OBJECT_STORE_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
"""Where the object stores' clients (pyarrow, boto, fsspec) read their credentials from the environment."""


def is_credential(name: str) -> bool:
    """Whether an environment variable's name looks like it holds a secret."""
    return any(word in name.upper() for word in CREDENTIAL_WORDS)


def withheld_from_workers(name: str, *, object_store: bool) -> bool:
    """Whether the embedded Ray's processes start without the driver's variable ``name``: every
    credential but Ray's own (its auth token, which its servers need), and the object stores'
    when the run reads or writes no object store (``object_store``). The workers never talk to
    the tracking server: their metrics reach it through the driver."""
    if not is_credential(name) or name.startswith("RAY_"):
        return False
    return not (object_store and name.upper().startswith(OBJECT_STORE_PREFIXES))


def passthrough_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The communication- and storage-tuning subset of ``environ`` to set in every worker."""
    return {name: value for name, value in environ.items()
            if name.startswith(PASSED_PREFIXES) and name not in NEVER_PASSED
            and not is_credential(name)}
