"""Hydra config tree (a package so it ships with the install: ``pkg://conf``)."""
