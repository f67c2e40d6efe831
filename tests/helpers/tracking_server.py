"""A real `mlflow server` behind MLflow's basic authentication, as the tests start one."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.tracking_overhead import launch_mlflow_server, stop, wait_healthy
from helpers.processes import free_port

ADMIN = "admin"


@contextmanager
def auth_server(root: Path, config: Path) -> Iterator[dict]:
    """An `mlflow server` storing its runs in ``root``, with one admin user.

    The admin password is bootstrapped from the auth app's ini file, kept in ``config``, apart
    from the server's store so that the store can be searched for the password a run must not leak.
    """
    password = f"Pw-{secrets.token_hex(8)}"
    (config / "auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{config / 'users.db'}\n"
        f"admin_username = {ADMIN}\nadmin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    port = free_port()
    proc = launch_mlflow_server(root, port, app_name="basic-auth",
                                env={"MLFLOW_AUTH_CONFIG_PATH": str(config / "auth.ini"),
                                     "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield {"url": url, "password": password, "store": root,
               "with_password": f"http://{ADMIN}:{password}@127.0.0.1:{port}"}
    finally:
        stop(proc)
