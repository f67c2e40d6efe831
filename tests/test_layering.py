"""The package layering, checked on the source: what each top-level package may import.

``plans/`` is the pure core (no Ray, Hydra or MLflow; DeepSpeed only for its partition
functions); ``launchers/`` runs workers and knows no Hydra; neither knows any particular
workload: only ``workloads/`` may assume a language model or an image classifier. Imports
inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.config import REPO

FORBIDDEN = {
    "plans": {"ray", "hydra", "omegaconf", "mlflow", "workloads", "launchers", "orchestrator"},
    "launchers": {"hydra", "omegaconf", "workloads", "orchestrator"},
    "workloads": {"orchestrator", "launchers"},
}


def imported_roots(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add((node.module.split(".")[0], node.lineno))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_or_beside_its_layer(package):
    offences = [f"{path.relative_to(REPO)}:{line} imports {root}"
                for path in sorted((REPO / package).rglob("*.py"))
                for root, line in sorted(imported_roots(path)) if root in FORBIDDEN[package]]
    assert offences == []


def test_only_the_deepspeed_engine_imports_deepspeed_in_launchers():
    """The worker's loop and the other engines know DeepSpeed only through its engine package."""
    engine = REPO / "launchers" / "engines" / "deepspeed"
    offences = [f"{path.relative_to(REPO)}:{line}"
                for path in sorted((REPO / "launchers").rglob("*.py")) if engine not in path.parents
                for root, line in sorted(imported_roots(path)) if root == "deepspeed"]
    assert offences == []
