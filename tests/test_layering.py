"""The package layering, checked on the source: what each of orch's sub-packages may import.

``orch/plans/`` is the pure core (no Ray, Hydra or MLflow; DeepSpeed only inside its engine spec's
functions, see tests/test_engine_seam.py); ``orch/launchers/`` runs workers and knows no Hydra;
neither knows any particular workload: only ``orch/workloads/`` may assume a language model or an
image classifier. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.config import REPO

LAYERS = ("plans", "launchers", "workloads")
"""orch's sub-packages with a layer of their own; every other part of ``orch`` is the CLI and its glue
(``app`` below), which may import them all."""
FORBIDDEN = {
    "plans": {"ray", "hydra", "omegaconf", "mlflow", "workloads", "launchers", "app"},
    "launchers": {"hydra", "omegaconf", "workloads", "app"},
    "workloads": {"app", "launchers"},
}
PACKAGE = REPO / "orch"


def layer_of(module: str) -> str:
    """The layer an absolute import names: orch's sub-package, ``app`` for the rest of orch, or the
    top-level name of anything else (``ray``, ``deepspeed``)."""
    parts = module.split(".")
    if parts[0] != "orch":
        return parts[0]
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "app"


def imported_roots(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(layer_of(alias.name), node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "orch":  # from orch import x: x is a module of the app or a layer
                roots |= {(layer_of(f"orch.{alias.name}"), node.lineno) for alias in node.names}
            else:
                roots.add((layer_of(node.module), node.lineno))
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_or_beside_its_layer(package):
    offences = [f"{path.relative_to(REPO)}:{line} imports {root}"
                for path in sorted((PACKAGE / package).rglob("*.py"))
                for root, line in sorted(imported_roots(path)) if root in FORBIDDEN[package]]
    assert offences == []


def test_only_the_deepspeed_engine_imports_deepspeed_in_launchers():
    """The worker's loop and the other engines know DeepSpeed only through its engine package."""
    engine = PACKAGE / "launchers" / "engines" / "deepspeed"
    offences = [f"{path.relative_to(REPO)}:{line}"
                for path in sorted((PACKAGE / "launchers").rglob("*.py")) if engine not in path.parents
                for root, line in sorted(imported_roots(path)) if root == "deepspeed"]
    assert offences == []
