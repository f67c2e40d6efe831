"""The tuned plan as a file: a plan option that extends the plan schema like the shipped ones,
written outside the installed package (``tuned_plans/plan/<tune.name>.yaml``, ``tune.out``, or a URI)
and found again through Hydra's search path (``--config-dir``)."""

from __future__ import annotations

import dataclasses
import datetime
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

import conf
from launchers.storage import RemoteDir, is_remote, location_violation
from orchestrator.config import RunConfig
from plans.errors import PlanError, Violation
from plans.resolve import ResolvedPlan
from plans.search_space import plan_spec

if TYPE_CHECKING:
    from orchestrator.tune_result import TuneResult


def plan_values(plan: ResolvedPlan) -> dict:
    spec = plan_spec(plan)
    return {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(spec).items()}


def plan_overrides(plan: ResolvedPlan, cfg: RunConfig) -> list[str]:
    """The winner as `orch train` overrides (every field, so no default can differ)."""
    values = plan_values(plan)
    out = [f"plan.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
           for k, v in values.items()]
    if cfg.train.global_batch_size:
        out.append(f"train.global_batch_size={cfg.train.global_batch_size}")
    return out


TUNED_PLANS_DIR = Path("tuned_plans")
"""Where tuned plans go by default, under the current directory: ``tuned_plans/plan/<tune.name>.yaml``,
a config directory Hydra adds to its search path with ``--config-dir tuned_plans``. Never inside the
installed package (site-packages, or the checkout of an editable install)."""

def plan_file_path(cfg: RunConfig) -> Path:
    """The local plan file (see :func:`write_plan_file` for ``tune.out`` on object storage)."""
    if cfg.tune.out:
        return Path(cfg.tune.out).expanduser()
    return TUNED_PLANS_DIR / "plan" / f"{cfg.tune.name}.yaml"


def _config_dir(plan_file: Path) -> Path | None:
    """The config directory that makes ``plan_file`` the option ``plan=<its stem>`` (its parent's
    parent, when its parent is named ``plan``), else None."""
    return plan_file.parent.parent if plan_file.parent.name == "plan" else None


def check_plan_file(cfg: RunConfig) -> None:
    """Refuse a plan file name that a shipped plan would shadow: Hydra looks in the package's
    conf/ before a ``--config-dir``, so ``plan=<name>`` would compose the shipped plan instead
    (and the plan schema, which every plan file extends, would extend itself)."""
    from hydra.core.config_store import ConfigStore

    if cfg.tune.out and is_remote(cfg.tune.out):
        problem = location_violation(_remote_parent(cfg.tune.out)[0])
        if problem:
            why, _, fix = problem.partition(" Fix: ")
            raise PlanError([Violation("tune.out", cfg.tune.out, f"its directory {why}", fix)])
        return
    path = plan_file_path(cfg)
    shipped = Path(conf.__file__).resolve().parent / "plan" / path.name
    registered = path.name in ConfigStore.instance().repo.get("plan", {})
    if _config_dir(path) is None or not (shipped.exists() or registered):
        return
    if cfg.tune.out:
        field_name, value, fix = "tune.out", cfg.tune.out, "give the file another name"
    else:
        field_name, value, fix = "tune.name", cfg.tune.name, "choose another name (tune.name=...)"
    raise PlanError([Violation(field_name, value, f"plan={path.stem} names a plan shipped with orch; the tuned "
                               "plan could not be selected by that name.", fix)])


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
    header = (f"# Written by `orch tune` on {datetime.date.today()} for {model_cfg.get('_target_', 'the model')} "
              f"on {cluster.nodes} node(s) x {cluster.devices_per_node} {cluster.accelerator.value} device(s), "
              f"global batch {result.global_batch_size}:\n# {how}.\n")
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": ["plan_schema", "_self_"], **plan_values(plan)}))
    result.plan_text = header + body
    if cfg.tune.out and is_remote(cfg.tune.out):
        directory, name = _remote_parent(cfg.tune.out)
        RemoteDir(directory).write_text(name, result.plan_text)
        return cfg.tune.out
    path = plan_file_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.plan_text)
    return path


def _remote_parent(uri: str) -> tuple[str, str]:
    """``s3://bucket/dir/plan.yaml`` → ``("s3://bucket/dir", "plan.yaml")``."""
    directory, _, name = uri.rstrip("/").rpartition("/")
    return directory, name
