"""Hydra config tree (a package so it ships with the install: ``pkg://orch.conf``). It lives
inside ``orch`` so that a ``conf/`` in the working directory, as Hydra's tutorials name a
config directory, can never be imported in its place."""
