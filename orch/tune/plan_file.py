"""The tuned plan as a file: a plan option that extends the plan schema like the shipped ones,
written outside the installed package (``tuned_plans/plan/<tune.name>.yaml``, ``tune.out``, or a URI)
and found again through Hydra's search path (``--config-dir``)."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import re
import shlex
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from orch import conf
from orch.config import RunConfig
from orch.launchers.storage import RemoteDir, location_violation
from orch.plans.errors import PlanError, Violation
from orch.plans.resolve import ResolvedPlan
from orch.plans.storage.locations import (
    StorageTimeout,
    bounded,
    is_remote,
    probe_limit_s,
    unwritable_reason,
    write_whole,
)

if TYPE_CHECKING:
    from orch.tune.result import TuneResult


_WRITABLE_FIX = "write it to a directory this user can write: tune.out=DIR/plan/NAME.yaml"


def plan_values(plan: ResolvedPlan) -> dict:
    # Imported here: the search space imports torch, which checking a plan file needs none of.
    from orch.plans.search.space import plan_spec

    spec = plan_spec(plan)
    return {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(spec).items()}


def _flat(values: dict, prefix: str) -> dict:
    """``{"fsdp": {"hybrid": False}}`` → ``{"plan.fsdp.hybrid": False}``: nested settings as one override each."""
    out = {}
    for key, value in values.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def plan_overrides(plan: ResolvedPlan, cfg: RunConfig) -> list[str]:
    """The winner as `orch train` overrides (every field, so no default can differ)."""
    values = _flat(plan_values(plan), "plan.")
    out = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
           for k, v in values.items()]
    if cfg.train.global_batch_size:
        out.append(f"train.global_batch_size={cfg.train.global_batch_size}")
    return out


TUNED_PLANS_DIR = Path("tuned_plans")
"""Where tuned plans go by default, under the current directory: ``tuned_plans/plan/<tune.name>.yaml``,
a config directory Hydra adds to its search path with ``--config-dir tuned_plans``. Never inside the
installed package (site-packages, or the checkout of an editable install)."""

TUNED_PLAN_HEADER = "# Written by `orch tune`"
"""How every plan file :func:`write_plan_file` writes begins: what an existing file must begin with to
be replaced by a new one."""

_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""A ``tune.name``: one file name, usable as ``plan=<name>``, that no path can be made of."""

_PACKAGES = ("orch",)
"""The top-level package orch installs, for when its distribution's metadata cannot be read
(running from a source tree that was never installed)."""


def plan_file_path(cfg: RunConfig) -> Path:
    """The local plan file (see :func:`write_plan_file` for ``tune.out`` on object storage)."""
    if cfg.tune.out:
        return Path(cfg.tune.out).expanduser()
    return TUNED_PLANS_DIR / "plan" / f"{cfg.tune.name}.yaml"


def is_tuned_plan(text: str) -> bool:
    """Whether ``text`` is a plan file `orch tune` wrote (and may replace)."""
    return text.startswith(TUNED_PLAN_HEADER)


def package_dirs() -> list[Path]:
    """The directories of orch's own packages as this process imports them, symlinks resolved."""
    try:
        names = (metadata.distribution("orch").read_text("top_level.txt") or "").split()
    except metadata.PackageNotFoundError:
        names = []
    dirs = []
    for name in names or _PACKAGES:
        spec = importlib.util.find_spec(name)
        # orch's packages all have an __init__.py. A folder without one is the user's: an install
        # made before the configs moved into orch/ still names `conf` in its metadata.
        if spec is not None and spec.origin and spec.submodule_search_locations:
            dirs += [Path(os.path.realpath(location)) for location in spec.submodule_search_locations]
    return dirs


def _config_dir(plan_file: Path) -> Path | None:
    """The config directory that makes ``plan_file`` the option ``plan=<its stem>`` (its parent's
    parent, when its parent is named ``plan``), else None."""
    return plan_file.parent.parent if plan_file.parent.name == "plan" else None


def check_plan_file(cfg: RunConfig) -> None:
    """Refuse, before anything runs, a plan file that would be written where it must not be:

    - a ``tune.name`` that is not a plain name (it would make a path out of ``tuned_plans/``);
    - a path inside the installed package, whose presets every command composes;
    - an existing file that is not a tuned plan (or a directory): only a tuned plan is replaced;
    - a name that a shipped plan would shadow: Hydra looks in the package's configs before a
      ``--config-dir``, so ``plan=<name>`` would compose the shipped plan instead (and the plan
      schema, which every plan file extends, would extend itself).
    """
    from hydra.core.config_store import ConfigStore

    if not _PLAIN_NAME.fullmatch(cfg.tune.name):
        raise PlanError([Violation("tune.name", cfg.tune.name, "is not a plain name: the tuned plan is written to "
                                   f"{TUNED_PLANS_DIR}/plan/<tune.name>.yaml and selected as plan=<tune.name>.",
                                   "use letters, digits, '_' and '-' only (tune.name=tuned_v2), or tune.out=PATH "
                                   "to write the plan file elsewhere")])
    if cfg.tune.out and is_remote(cfg.tune.out):
        directory, _ = _remote_parent(cfg.tune.out)
        problem = location_violation(directory)
        if problem:
            why, _, fix = problem.partition(" Fix: ")
            raise PlanError([Violation("tune.out", cfg.tune.out, f"its directory {why}", fix)])
        _check_existing("tune.out", cfg.tune.out, _remote_text(cfg.tune.out))
        return
    path = plan_file_path(cfg)
    field_name, value = _plan_file_field(cfg)
    fix = "give the file another name" if cfg.tune.out else "choose another name (tune.name=...)"
    _check_local(field_name, value, path)
    shipped = Path(conf.__file__).resolve().parent / "plan" / path.name
    registered = path.name in ConfigStore.instance().repo.get("plan", {})
    if _config_dir(path) is None or not (shipped.exists() or registered):
        return
    raise PlanError([Violation(field_name, value, f"plan={path.stem} names a plan shipped with orch; the tuned "
                               "plan could not be selected by that name.", fix)])


def _check_local(field_name: str, value: str, path: Path) -> None:
    """Refuse a local plan file inside the package, a directory, or an existing file that is not a
    tuned plan (a symlink is judged by what it points to)."""
    real = Path(os.path.realpath(path))
    for package in package_dirs():
        if real.is_relative_to(package):
            raise PlanError([Violation(field_name, value, f"is inside the installed orch package ({package}), whose "
                                       "files every command reads; orch tune never writes there.",
                                       "write the plan outside it: leave tune.out unset for "
                                       f"./{TUNED_PLANS_DIR}/plan/<tune.name>.yaml, or tune.out=DIR/plan/NAME.yaml")])
    if real.is_dir():
        raise PlanError([Violation(field_name, value, "is a directory, not a plan file.",
                                   "name a file: tune.out=DIR/plan/NAME.yaml")])
    if real.exists():
        _check_existing(field_name, value, _local_text(real))
    # Checked before the search and the trials, whose result would otherwise have nowhere to go.
    if why := unwritable_reason(real.parent):
        raise PlanError([Violation(field_name, value, f"the plan file cannot be written to {real}: {why}.",
                                   _WRITABLE_FIX)])


def _check_existing(field_name: str, value: str, text: str | None) -> None:
    """Refuse to replace an existing file (``text``; None when there is none) that orch tune did not write."""
    if text is None or is_tuned_plan(text):
        return
    raise PlanError([Violation(field_name, value, f"is an existing file that orch tune did not write (it does not "
                               f"begin with {TUNED_PLAN_HEADER!r}); it is left as it is.",
                               "name a new file, or move that one away first if it should be replaced")])


def _local_text(path: Path) -> str:
    """The beginning of an existing file, as far as it can be read ('' when it cannot: not a plan)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(len(TUNED_PLAN_HEADER))
    except (OSError, UnicodeDecodeError):
        return ""


def _remote_text(uri: str) -> str | None:
    """The existing object's text at ``tune.out=uri`` (None when there is none; '' when it is not
    text), read within ``cluster.connect_timeout_s``."""
    directory, name = _remote_parent(uri)
    try:
        return bounded(lambda: RemoteDir(directory, timeout_s=probe_limit_s()).read_text(name))
    except UnicodeDecodeError:
        return ""
    except StorageTimeout as error:
        raise PlanError([Violation("tune.out", uri, error.reason(), error.fix())]) from None


def _write_remote(uri: str, text: str) -> None:
    """Write the plan file at ``tune.out=uri`` within ``cluster.connect_timeout_s`` (a few hundred bytes)."""
    directory, name = _remote_parent(uri)
    try:
        bounded(lambda: RemoteDir(directory, timeout_s=probe_limit_s()).write_text(name, text))
    except StorageTimeout as error:
        raise PlanError([Violation("tune.out", uri, error.reason(), error.fix())]) from None
    except OSError as error:  # pyarrow's for a refused write
        raise PlanError([Violation("tune.out", uri, f"the plan file could not be written ({error}).",
                                   "check the credentials' rights on that prefix, or write it elsewhere "
                                   "(tune.out=PATH or another URI)")]) from None


def train_command(result: TuneResult) -> str | None:
    """The `orch train` command line that trains the winner from its plan file, if it is usable as
    ``plan=<name>``; relative paths stay relative, as the user gave them (or as the default is)."""
    root = _config_dir(result.plan_file) if isinstance(result.plan_file, Path) else None
    if root is None:
        return None
    batch = [o for o in result.overrides if o.startswith("train.global_batch_size=")]
    return " ".join(["orch train", "--config-dir", shlex.quote(str(root)),
                     f"plan={shlex.quote(result.plan_file.stem)}", *batch])


def write_plan_file(plan: ResolvedPlan, cfg: RunConfig, model_cfg: dict, cluster, result: TuneResult) -> Path | str:
    """The winner as a plan file that extends the plan schema, like the shipped ones; written to
    object storage when ``tune.out`` is a URI (a submitted tune's result, out of the job's
    working directory)."""
    how = (f"measured {result.winner_trial.tokens_per_s:,.0f} tokens/s in a trial"
           if result.winner_trial else f"predicted {result.winner.predicted.tokens_per_s:,.0f} tokens/s")
    header = (f"{TUNED_PLAN_HEADER} on {datetime.date.today()} for {model_cfg.get('_target_', 'the model')} "
              f"on {cluster.nodes} node(s) x {cluster.devices_per_node} {cluster.accelerator.value} device(s), "
              f"global batch {result.global_batch_size}:\n# {how}.\n")
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": ["plan_schema", "_self_"], **plan_values(plan)}))
    result.plan_text = header + body
    # Checked again: trials ran since check_plan_file, and something else may have written the file.
    try:
        if cfg.tune.out and is_remote(cfg.tune.out):
            _check_existing("tune.out", cfg.tune.out, _remote_text(cfg.tune.out))
            _write_remote(cfg.tune.out, result.plan_text)
            return cfg.tune.out
        check_plan_file(cfg)
        return _write_local(plan_file_path(cfg), result.plan_text, cfg)
    except PlanError as error:
        # The search and its trials are done: their result reaches the user even without its file.
        *others, last = error.violations
        kept = dataclasses.replace(last, fix=f"{last.fix}; this run's tuned plan, to save by hand:\n{result.plan_text}")
        raise PlanError([*others, kept]) from None


def _write_local(path: Path, text: str, cfg: RunConfig) -> Path:
    """Write the plan file whole or not at all (a file cut short would still begin with the header),
    through a symlink to what it points to."""
    real = Path(os.path.realpath(path))
    try:
        write_whole(real, text)
    except OSError as error:
        raise PlanError([Violation(*_plan_file_field(cfg), f"the plan file could not be written to {real} "
                                   f"({error.strerror or error}).", _WRITABLE_FIX)]) from None
    return path


def _plan_file_field(cfg: RunConfig) -> tuple[str, str]:
    """The setting that places the local plan file, and its value: tune.out when set, else tune.name."""
    return ("tune.out", cfg.tune.out) if cfg.tune.out else ("tune.name", cfg.tune.name)


def _remote_parent(uri: str) -> tuple[str, str]:
    """``s3://bucket/dir/plan.yaml`` → ``("s3://bucket/dir", "plan.yaml")``."""
    directory, _, name = uri.rstrip("/").rpartition("/")
    return directory, name
