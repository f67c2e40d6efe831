"""A fault the cluster tests inject into a real Ray head, loaded through its PYTHONPATH.

While the file named by ORCH_FAULT_CLIENT_SERVER exists, the next Ray client session server
(``python -m ray.util.client.server --mode=specific-server``) removes it and exits as it starts,
the way one does whose port is taken: the head then answers the client with an initialization
failure ("Starting Ray client server failed" or, when the process was seen running before it
exited, "Proxy failed to Connect to backend"). Every other process, and every process once the
file is gone, is untouched.
"""

import os


def _fail_one_client_session_server() -> None:
    marker = os.environ.get("ORCH_FAULT_CLIENT_SERVER")
    if not marker or not os.path.exists(marker):
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            if b"--mode=specific-server" not in f.read().split(b"\0"):
                return
        os.remove(marker)  # only the one process that removes it fails
    except OSError:
        return
    os._exit(3)  # SystemExit would be reported by site.py, not end the process


_fail_one_client_session_server()
