"""Keep tracking credentials out of everything `orch` writes or prints.

A user may write ``tracking.uri=http://user:password@host:5000``. MLflow's client does not need
the password in the URI: it reads ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``
from the environment. So the credentials are moved there, for this process only, before the URI
enters the config: on the command line before Hydra sees it (Hydra writes its overrides and the
composed config to ``outputs/*/.hydra/`` before any of our code runs), and in the composed config
for a URI that came from a YAML file, whose copies Hydra already wrote are then scrubbed.
Anything else printed or logged that may hold a URI goes through :func:`redact_text`.

Any other credential on the command line is refused before Hydra sees it
(:func:`refuse_secret_overrides`): an override whose key names a credential
(``+hydra.job.env_set.MLFLOW_TRACKING_PASSWORD=...``, ``+submit.env.HF_TOKEN=...``,
``+model.api_key=...``), judged by the key, since no form of the value tells a secret apart.
Refused rather than moved into the environment: one rule for every command and route, where a
moved variable would silently not reach a submitted job, and the user's fix (export it) is the
safe way in every case.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from omegaconf import DictConfig, open_dict

from orch.launchers.passthrough import credential_word
from orch.plans.errors import OrchError

USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"

# scheme://userinfo@ ; greedy up to the last "@" before the path, as urlsplit reads a netloc.
# Hydra escapes ":" as "\:" in the overrides it records for a sweep job (ray\://u\:pw@h).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*\\?://)(?P<userinfo>[^/?#\s'\"]*)@")
# Only MLflow's REST client (a tracking server) reads the environment variables. A database store
# (postgresql://user:pw@host/db) takes its password from the URI alone: it stays in memory, and
# the copies written to disk are scrubbed (protect_config) or redacted (redact_text).
_SERVER_USERINFO = re.compile(r"(?P<scheme>https?://)(?P<userinfo>[^/?#\s'\"]*)@", re.IGNORECASE)

# Overrides that set the tracking URI: `tracking.uri=`, `+tracking.uri=`, `++tracking.uri=`.
_TRACKING_URI_KEY = re.compile(r"^\+{0,2}tracking\.uri=")
# The overrides that set a variable of the command's environment (Hydra's) or of a submitted job's.
_ENV_KEYS = ("hydra.job.env_set.", "submit.env.")
CLUSTER_CREDENTIALS_FIX = ("keep the credentials in the cluster's own environment (where `ray start` runs on the "
                           "head node) or your secrets mechanism; see docs/reliability.md, Submitted jobs")


class CredentialsError(OrchError):
    """Credentials given in a way that cannot be kept secret or cannot be used."""


@dataclass(frozen=True)
class Credentials:
    """A user name and password for HTTP basic authentication, percent-decoded."""

    username: str
    password: str

    def __repr__(self) -> str:  # never the password, whatever prints this object
        return f"Credentials(username={self.username!r}, password='***')"


def redact_uri(uri: str) -> str:
    """The URI without its user:password, as printed or recorded."""
    return split_credentials(uri)[0]


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every ``scheme://user:password@`` in it removed."""
    return _USERINFO.sub(lambda m: m.group("scheme"), text)


def split_credentials(uri: str) -> tuple[str, Credentials | None]:
    """``http://u:p@host:5000/x`` → ``("http://host:5000/x", Credentials("u", "p"))``."""
    match = _USERINFO.match(uri)  # not urlsplit: it raises on a malformed host, which is MLflow's to report
    if not match:
        return uri, None
    username, _, password = match.group("userinfo").partition(":")
    return match.group("scheme") + uri[match.end():], Credentials(unquote(username), unquote(password))


def server_credentials(uri: str) -> tuple[str, Credentials | None]:
    """Like :func:`split_credentials`, for the URIs of a tracking server only (http, https);
    any other URI is returned as it is, with None."""
    if not _SERVER_USERINFO.match(uri):
        return uri, None
    return split_credentials(uri)


def use_credentials(credentials: Credentials, origin: str) -> None:
    """Hand ``credentials`` to MLflow's client (this process and those it starts), saying so once.

    Credentials written into the URI are the user's explicit choice for this command, so they
    win over variables already set in the environment.
    """
    os.environ[USERNAME_ENV] = credentials.username
    os.environ[PASSWORD_ENV] = credentials.password
    print(f"note: the user:password in {origin} is used through {USERNAME_ENV} / {PASSWORD_ENV} and recorded "
          f"nowhere; set those variables instead of writing a password into a URI (shell history, ps)",
          file=sys.stderr)


def move_argv_credentials(argv: list[str]) -> list[str]:
    """The command line with the credentials of ``tracking.uri=...`` moved into the environment.

    Runs before Hydra parses ``argv``, so the password never reaches the config, Hydra's
    ``.hydra/overrides.yaml`` or the MLflow params. A sweep over URIs with different credentials
    cannot share one pair of variables and is refused.
    """
    found: set[Credentials] = set()
    cleaned = []
    for arg in argv:
        if _TRACKING_URI_KEY.match(arg):
            for match in _SERVER_USERINFO.finditer(arg):
                found.add(split_credentials(f"{match.group('scheme')}{match.group('userinfo')}@h")[1])
            arg = _SERVER_USERINFO.sub(lambda m: m.group("scheme"), arg)
        cleaned.append(arg)
    if len(found) > 1:
        raise CredentialsError(
            "tracking.uri: the swept URIs carry different credentials, but MLflow takes one user per process. "
            f"Fix: sweep URIs without user:password@ and set {USERNAME_ENV} / {PASSWORD_ENV}, or run one "
            "command per server")
    if found:
        use_credentials(found.pop(), "tracking.uri")
    return cleaned


def protect_config(cfg: DictConfig) -> None:
    """Move credentials out of the composed ``cfg`` (a URI from a YAML file) and out of the copies
    of the config Hydra wrote before the command started.

    Call it first in every command. ``cluster.address`` and a database tracking URI keep their
    values (Ray and SQLAlchemy take no credentials from these variables); only the copies written
    to disk lose their userinfo.
    """
    tracking = cfg.get("tracking")
    uri = tracking.get("uri") if tracking is not None else None
    if isinstance(uri, str):
        clean, credentials = server_credentials(uri)
        if credentials is not None:
            with open_dict(cfg):
                cfg.tracking.uri = clean
            use_credentials(credentials, "tracking.uri (from a config file)")
    for path in hydra_written_files():
        scrub_file(path)


def hydra_written_files() -> list[Path]:
    """The YAML files Hydra wrote for this job (and its sweep), when Hydra runs the command."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return []
    hydra_cfg = HydraConfig.get()
    files = []
    if hydra_cfg.output_subdir is not None:
        files += sorted(Path(hydra_cfg.runtime.output_dir, hydra_cfg.output_subdir).glob("*.yaml"))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        files.append(Path(hydra_cfg.sweep.dir, "multirun.yaml"))
    return [f for f in files if f.is_file()]


def scrub_file(path: Path) -> None:
    """Rewrite ``path`` without URI credentials, when it holds any."""
    text = path.read_text()
    clean = redact_text(text)
    if clean != text:
        path.write_text(clean)


def secret_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """Each key that a command-line override gives a value and whose name says it is a credential
    (:func:`orch.launchers.passthrough.credential_word` of its last component), with that word.

    Every form counts: ``key=``, ``+key=``, ``++key=``, ``~key=value``, a sweep, and the keys of a
    dict value (``hydra.job.env_set={HF_TOKEN:...}`` gives ``hydra.job.env_set.HF_TOKEN``). A
    deletion without a value holds nothing. The values are never looked at beyond their keys.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found: dict[str, str] = {}
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:  # Hydra refuses it too, but would print it: judge the key as written
            key = arg.partition("=")[0].lstrip("+~").partition("@")[0]
            found.update(_secret_keys(key, None))
            continue
        found.update(_secret_keys(override.key_or_group, override.value()))
    return list(found.items())


def _secret_keys(key: str, value: object) -> dict[str, str]:
    """``key`` and the keys nested in its ``value`` whose last component names a credential,
    with the word that does."""
    found = {}
    word = credential_word(key.rpartition(".")[2])
    if word is not None:
        found[key] = word
    for name, nested in _named_entries(value):
        found.update(_secret_keys(f"{key}.{name}", nested))
    return found


def _named_entries(value: object) -> list[tuple[object, object]]:
    """The entries of a dict in an override's value: the value itself, an element of a list, or a
    choice sweep's option."""
    from hydra.core.override_parser.types import ChoiceSweep

    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, ChoiceSweep):
        value = value.list
    if isinstance(value, list):
        return [entry for element in value for entry in _named_entries(element)]
    return []


def refuse_secret_overrides(overrides: list[str], command: str) -> None:
    """Refuse a credential given as an override (:func:`secret_overrides`) before Hydra records the
    command line in ``outputs/<date>/<time>/.hydra/`` and before anything prints or ships it.

    The fix names where the credential belongs instead: the shell's environment for a command run
    here (``hydra.job.env_set`` only copies a value into it), the cluster's for a submitted job.
    """
    found = secret_overrides(overrides)
    if not found:
        return
    if command == "submit":
        why = ("would be shipped in the job, whose command line and environment Ray shows to anyone who can list "
               "the cluster's jobs (dashboard, `ray job list`), and recorded by Hydra in outputs/<date>/<time>/.hydra/")
    else:
        why = "would be recorded by Hydra in outputs/<date>/<time>/.hydra/ (and stays in the shell's history)"
    lines = [f"a credential given as an override {why}; refused before anything is written or sent "
             "(values not shown):"]
    lines += [f"  - {key} (its name holds {word}). Fix: remove it and {_secret_fix(key, command)}"
              for key, word in found]
    raise CredentialsError("\n".join(lines))


def _secret_fix(key: str, command: str) -> str:
    """Where the credential of override ``key`` belongs instead."""
    if command == "submit":
        return CLUSTER_CREDENTIALS_FIX
    variable = next((key[len(prefix):] for prefix in _ENV_KEYS if key.startswith(prefix)), None)
    if variable is not None:
        return (f"export {variable} in the shell that runs `orch {command}` (or set it from your secrets "
                "mechanism): the command reads its environment")
    return ("let the code read the credential from an environment variable exported in your shell; a setting "
            "that is no secret can be set in a config file (--config-dir)")
