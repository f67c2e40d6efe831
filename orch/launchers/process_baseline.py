"""A worker process as it was before its first run, and putting it back before the next one.

A reused worker (:mod:`orch.launchers.worker_pool`) must meet its next run as a new process would
in everything a run can change: the environment variables a job set, the import path, and the
user's own modules (a model or objective with module-level state, or code edited on disk
between two trials). Installed code (the standard library, site-packages, orch itself)
and compiled extensions stay imported: keeping them is the point, and an extension module cannot
be unloaded anyway.
"""

from __future__ import annotations

import gc
import importlib
import importlib.machinery
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)
"""Compiled extension modules: kept, since one cannot be unloaded."""


def installed_roots() -> tuple[str, ...]:
    """Folders whose modules stay imported between runs: this interpreter's libraries and orch."""
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.add(str(Path(__file__).resolve().parents[1]))  # orch's package
    return tuple(sorted(str(Path(root).resolve()) + os.sep for root in roots))


def is_user_module(module: object, roots: tuple[str, ...]) -> bool:
    """Whether ``module`` is the user's Python source: a file outside ``roots`` that is not a
    compiled extension. Built-in and namespace modules (no file) are not."""
    path = getattr(module, "__file__", None)
    if not path or path.endswith(_EXTENSIONS):
        return False
    try:
        resolved = str(Path(path).resolve())
    except OSError:
        return True
    return not resolved.startswith(roots)


@dataclass(frozen=True)
class ProcessBaseline:
    """The environment, import path and imported modules of a process at one moment."""

    env: dict[str, str]
    path: tuple[str, ...]
    modules: frozenset[str]

    @classmethod
    def now(cls) -> ProcessBaseline:
        return cls(env=dict(os.environ), path=tuple(sys.path), modules=frozenset(sys.modules))

    def restore(self) -> list[str]:
        """Put the environment and import path back, forget the user modules imported since, and
        collect the garbage a run left, frozen or not; returns the names of the modules forgotten."""
        for name in [name for name in os.environ if name not in self.env]:
            del os.environ[name]
        for name, value in self.env.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = self.path
        roots = installed_roots()
        forgotten = [name for name, module in list(sys.modules.items())
                     if name not in self.modules and is_user_module(module, roots)]
        for name in forgotten:
            del sys.modules[name]
        importlib.invalidate_caches()
        # A run's start-up ends by freezing what survived it (orch.launchers.lean_startup), the
        # run's engine and model included: frozen objects are never collected, so they are let go
        # of first; what survives the collection (imports) is frozen again.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return forgotten
