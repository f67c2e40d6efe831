"""Rebuild ``corpus.txt.gz``: the docstrings of the Python standard library as ASCII prose.

Run once with a CPython 3.11 (``python orch/workloads/make_corpus.py``); the output ships with the
project so every machine trains on the same bytes.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import pkgutil
import sys
import warnings
from pathlib import Path

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc_data",
        "ensurepip", "venv", "test", "xxlimited", "xxsubtype"}


def stdlib_docstrings() -> str:
    stdlib = f"{sys.base_prefix}/lib/python{sys.version_info.major}.{sys.version_info.minor}"
    names = sorted(m.name for m in pkgutil.iter_modules()
                   if not m.name.startswith("_") and getattr(m.module_finder, "path", "").startswith(stdlib)
                   and "site-packages" not in m.module_finder.path)
    docs = []
    for name in names:
        if name in SKIP:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # a stdlib module that cannot import here simply contributes nothing
            continue
        if doc := inspect.getdoc(module):
            docs.append(doc)
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                doc = inspect.getdoc(value)
                if doc and len(doc) > 80:
                    docs.append(doc)
    return "".join(c for c in "\n\n".join(docs) if ord(c) < 128)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out = Path(__file__).with_name("corpus.txt.gz")
    out.write_bytes(gzip.compress(stdlib_docstrings().encode(), compresslevel=9, mtime=0))
    print(f"wrote {out}")
