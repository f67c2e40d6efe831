"""What a user's project directory may hold that orch must leave alone."""

from __future__ import annotations

from pathlib import Path


def plant_packages_named_like_orchs_parts(project: Path) -> None:
    """Packages of the user's named as orch's parts were: ``plans``, ``workloads``, ``launchers``, each
    failing on import. Ray puts the driver's working directory first on the workers' import path,
    so while orch installed packages of those names every worker died importing the user's."""
    for name in ("plans", "workloads", "launchers", "orchestrator"):
        (project / name).mkdir(exist_ok=True)
        (project / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported by orch')\n")
