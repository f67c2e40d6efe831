"""Benchmarks, run from the repository root as modules: ``python -m bench.<name>`` (see bench/README.md)."""
