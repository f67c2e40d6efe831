"""Helpers the tests share: composing configs, starting Ray, watching processes. Fixtures are in conftest.py."""
