"""One door per engine: outside the engines' own modules nothing names an engine or imports its
library, and an engine from outside orch (an entry point naming its spec) is checked by `orch check`
like the shipped ones."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.config import REPO
from helpers.orch_command import orch_run
from helpers.processes import worker_env
from orch.launchers.engines import DRIVER_PARTS, engine_module
from orch.plans.engines import BUILT_IN, ENTRY_POINT_GROUP, engine_names, engine_spec

PACKAGE = REPO / "orch"
ENGINE_DIRS = (PACKAGE / "plans" / "engines", PACKAGE / "launchers" / "engines")
ENGINE_LIBRARIES = ("deepspeed", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def outside_the_engines() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if not any(d in path.parents for d in ENGINE_DIRS)]


def _names_an_engine(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in BUILT_IN


def test_no_module_outside_the_engines_branches_on_an_engines_name():
    """A comparison with an engine's name (``plan.engine == "fsdp2"``, ``"deepspeed" in ...``) is an
    ``if engine`` that the next engine would have to find; callers ask ``engine_spec(plan.engine)``."""
    offences = []
    for path in outside_the_engines():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare) and any(map(_names_an_engine, [node.left, *node.comparators])):
                offences.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.match_case) and _names_an_engine(getattr(node.pattern, "value", None)):
                offences.append(f"{path.relative_to(REPO)}:{node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    assert offences == []


def _imports(tree: ast.AST, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _engine_library(module: str) -> bool:
    return any(module == lib or module.startswith(f"{lib}.") for lib in ENGINE_LIBRARIES)


def test_only_engine_modules_import_deepspeed_or_torchs_fsdp_and_checkpoint():
    """Project-wide, lazy imports included: a workload, the planner or the CLI that needs one of
    them asks an engine module."""
    offences = [f"{path.relative_to(REPO)}:{line} imports {module}" for path in outside_the_engines()
                for module, line in _imports(ast.parse(path.read_text())) if _engine_library(module)]
    assert offences == []


def test_the_planners_engine_specs_import_no_engine_library_at_module_level():
    """The planner runs where no engine's library is initialised: a spec imports one inside the
    function that needs it (DeepSpeed's partition, its AutoTP presets)."""
    offences = [f"{path.relative_to(REPO)}:{line} imports {module}"
                for path in sorted(ENGINE_DIRS[0].glob("*.py"))
                for module, line in _imports(ast.parse(path.read_text()), top_level_only=True)
                if _engine_library(module) or module.startswith("torch.distributed")]
    assert offences == []


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_shipped_spec_names_its_runtime_and_the_driver_parts(name):
    spec = engine_spec(name)
    assert spec.name == name and spec.summary and spec.buffers_label
    for part in DRIVER_PARTS:
        assert engine_module(name, part).__name__ == f"{spec.runtime.partition(':')[0]}.{part}"


def test_an_unknown_engine_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine 'nope': known are deepspeed, fsdp2"):
        engine_spec("nope")
    assert engine_names()[:2] == ["deepspeed", "fsdp2"]


def _installed_example(root: Path) -> dict[str, str]:
    """An environment in which a package installed beside orch declares the example engine
    (tests/engines/example_engine.py) as an entry point, as ``pip install`` of a plugin would."""
    dist = root / "example_engine-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-engine\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nddp_example = example_engine:SPEC\n")
    env = worker_env()
    path = [str(root), str(REPO / "tests" / "engines"), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def test_an_engine_from_outside_orch_is_checked_like_the_shipped_ones(tmp_path):
    """`orch check plan.engine=ddp_example`: the example engine's rules, memory and description
    answer; its runtime is never imported (it does not even exist: check starts no worker)."""
    env = _installed_example(tmp_path)

    def check(*overrides: str) -> subprocess.CompletedProcess:
        return orch_run(["check", *overrides], cwd=tmp_path, env=env, timeout=300)

    ddp, zero0 = check("--json", "plan.engine=ddp_example"), check("--json", "plan.zero_stage=0")
    assert ddp.returncode == 0, ddp.stderr
    ddp_doc, zero0_doc = json.loads(ddp.stdout), json.loads(zero0.stdout)
    assert ddp_doc["feasible"] and ddp_doc["plan"]["engine"] == "ddp_example"
    # DDP replicates what ZeRO-0 replicates: the same model states on every rank.
    for key in ("params", "grads", "optimizer_states"):
        assert ddp_doc["per_device"][key] == zero0_doc["per_device"][key], key
    text = check("plan.engine=ddp_example")
    assert "DDP buckets" in text.stdout and "FITS with ddp_example" in text.stdout, text.stdout
    refused = check("plan.engine=ddp_example", "plan.zero_stage=2")
    assert refused.returncode == 2
    assert ("plan.zero_stage=2: torch DDP neither shards, pipelines nor offloads. Fix: leave plan.zero_stage at "
            "its default, or set plan.engine=deepspeed") in refused.stderr
    unknown = check("plan.engine=ddp")
    assert unknown.returncode == 2
    assert ("plan.engine='ddp': is not an engine orch has. Fix: set plan.engine to one of deepspeed, fsdp2, "
            "ddp_example") in unknown.stderr


def test_the_engine_specs_load_without_torch():
    """`orch train` resolves the plan, and so asks its engine's rules, while Ray starts and before
    torch is imported (orch.run.early_ray)."""
    code = ("import sys\nfrom orch.plans.engines import BUILT_IN, engine_spec\n"
            "specs = [engine_spec(name) for name in BUILT_IN]\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
