"""Ray token authentication for clients; must run before ``ray`` is imported."""

from __future__ import annotations

import os
import sys


def use_token_auth_if_available() -> None:
    """Send the cluster's auth token when one is on this machine.

    Ray 2.60's ``ray start`` enables token authentication and saves the token in
    ``~/.ray/auth_token``, but a client only sends it when ``RAY_AUTH_MODE=token``, and Ray
    reads that variable once, when it is imported. Without it, joining a ``ray start``
    cluster fails with InvalidAuthToken. A user's explicit ``RAY_AUTH_MODE`` always wins.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    if "ray" in sys.modules:
        raise RuntimeError("use_token_auth_if_available() must run before ray is imported")
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH", os.path.expanduser("~/.ray/auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"
