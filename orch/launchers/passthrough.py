"""Which of the driver's environment variables the workers inherit.

NCCL, CUDA and the network transports beneath them (UCX, libfabric) are tuned through
environment variables a cluster's administrators set where the job is launched; Ray actors do
not inherit the driver's environment, so without this the workers would run with the defaults.
``CUDA_VISIBLE_DEVICES`` is excluded: each node's workers get their own (:mod:`orch.launchers.devices`).
The object store's endpoint and region (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``) go along, so
workers write checkpoints to the store the driver checked (:mod:`orch.launchers.storage`).
Names that look like credentials are never passed this way, whatever their prefix: a node reads
its own (its environment, a profile, an instance role). :func:`credential_word` is the one test of
a name every check uses: these variables, ``orch submit``'s ``submit.env`` and the command-line
overrides every command refuses (:mod:`orch.credentials`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

PASSED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_", "UCX_", "FI_", "AWS_")
NEVER_PASSED = frozenset({"CUDA_VISIBLE_DEVICES"})
CREDENTIAL_WORDS = ("PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "CREDENTIAL", "API_KEY", "ACCESS_KEY",
                    "PRIVATE_KEY")
"""Anywhere in a name, its separators and case ignored, these name a credential: ``PGPASSWORD``,
``AWS_SECRET_ACCESS_KEY``, ``apiKey``, ``GOOGLE_APPLICATION_CREDENTIALS``."""
CREDENTIAL_ENDINGS = ("TOKEN", "AUTH", "PWD", "PASS")
"""As a name's last word these name a credential (``HF_TOKEN``, ``HF_AUTH``, ``DB_PWD``, ``DB_PASS``);
elsewhere they do not (``max_tokens``, ``tokenizer``, ``AUTHOR``, ``RAY_AUTH_MODE``, ``PASS_COUNT``).
``PWD`` and ``PASS`` alone are no credential (the shell's working directory, a flag); ``token`` and
``auth`` alone are."""
KEY_QUALIFIERS = frozenset({"ACCOUNT", "STORAGE", "SIGNING", "ENCRYPTION", "MASTER", "CLIENT", "SERVICE", "SSH",
                            "LICENSE", "AUTH", "SECRET", "ACCESS", "API", "PRIVATE"})
"""A last word ``KEY`` names a credential only after one of these (``AZURE_STORAGE_ACCOUNT_KEY``,
``signing_key``): a key is as often a dict's, a column's or a config's (``text_key``, ``no_such_key``,
``num_key_value_heads``)."""
NOT_CREDENTIAL_QUALIFIERS = frozenset({
    "PAD", "EOS", "BOS", "UNK", "SEP", "CLS", "MASK", "SPECIAL", "START", "END", "STOP", "MAX", "MIN", "NUM",
    "TEXT", "LABEL", "IMAGE", "COLUMN", "FIELD", "SORT", "GROUP", "PARTITION", "CACHE", "HASH", "RNG", "SEED",
    "FORWARD", "BACKWARD", "FWD", "BWD", "FIRST", "SECOND", "LAST", "SINGLE", "MULTI", "ONE", "TWO", "EVAL",
    "TRAIN", "TEST", "DATA", "EPOCH", "RENDER", "SHADOW"})
"""Words before such an ending that make it a model's or dataset's setting: ``pad_token``, ``eos_token``,
``max_token``, ``text_key``, ``rng_key``, ``backward_pass``, ``eval_pass``."""
_LONE_CREDENTIALS = ("TOKEN", "AUTH")
# The words of a name: split at separators and at case changes (apiKey, HFToken), upper-cased.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
OBJECT_STORE_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
"""Where the object stores' clients (pyarrow, boto, fsspec) read their credentials from the environment."""


def credential_word(name: str) -> str | None:
    """The word that makes ``name`` (an environment variable's, or a config key's last component)
    look like it holds a secret, or None.

    Judged by words, not substrings, so that a model's ``max_tokens`` or ``tokenizer`` and a
    dataset's ``text_key`` are not taken for credentials, while ``DB_PASSWD`` and ``HF_AUTH`` are.
    """
    words = [word.upper() for word in _WORD.findall(name)]
    glued = "".join(words)
    for word in CREDENTIAL_WORDS:
        if word.replace("_", "") in glued:
            return word
    if len(words) > 1 and words[-1] == "KEY" and words[-2] in KEY_QUALIFIERS:
        return "KEY"
    if not words or words[-1] not in CREDENTIAL_ENDINGS:
        return None
    if len(words) == 1:
        return words[0] if words[0] in _LONE_CREDENTIALS else None
    return None if words[-2] in NOT_CREDENTIAL_QUALIFIERS else words[-1]


def is_credential(name: str) -> bool:
    """Whether an environment variable's name looks like it holds a secret (:func:`credential_word`)."""
    return credential_word(name) is not None


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
