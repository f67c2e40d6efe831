"""A local sqlite tracking store, checked without MLflow or torch.

`orch train` and `orch tune` run this check first, beside the declared values: a store MLflow
could not create would otherwise be found only when the store is opened, after the imports, the
model check and an early Ray, and MLflow itself retries such a store for about two minutes.
"""

from __future__ import annotations

from pathlib import Path

from orch.config import TrackingConfig
from orch.plans.errors import Violation
from orch.plans.storage.locations import unwritable_reason


def sqlite_database(uri: str) -> Path | None:
    """The database file of a ``sqlite:`` URI (None for other stores and in-memory sqlite)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url  # what MLflow parses it with; light, unlike MLflow

    database = make_url(uri).database
    if not database or database == ":memory:":
        return None
    return Path(database).absolute()


def sqlite_store_problem(uri: str) -> str | None:
    """Why a new sqlite store cannot be created at ``uri``, or None (an existing one, or another store)."""
    database = sqlite_database(uri)
    if database is None or database.exists():
        return None
    if why := unwritable_reason(database.parent):
        return f"cannot create the sqlite store {database}: {why}"
    return None


def local_store_violations(tracking: TrackingConfig) -> list[Violation]:
    """The tracking store as a declared-value problem: a sqlite store that cannot be created."""
    if not tracking.enabled or not (problem := sqlite_store_problem(tracking.uri)):
        return []
    return [Violation("tracking.uri", tracking.uri, f"{problem}.",
                      "choose a writable path (tracking.uri=sqlite:///DIR/mlflow.db), or an MLflow server")]
