"""The process group's rendezvous store, hosted by rank 0's actor on its node's address only."""

from __future__ import annotations

import socket

AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
"""Every rank a client of a store hosted outside ``init_process_group`` (torch's convention for
torchelastic's agent store)."""


class RendezvousHost:
    """torch's TCPStore server listening on ``ip`` only, for as long as this object lives.

    ``init_process_group(init_method="env://")`` would start the store inside rank 0 listening
    on all interfaces: torch has no bind address for it. A store started on a socket bound here
    listens where the node's other Ray servers do (loopback for the embedded Ray); the ranks
    then join it as clients, with :data:`AGENT_STORE_ENV` in their environment.
    """

    def __init__(self, ip: str):
        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((ip, 0))
        self._listener.listen(socket.SOMAXCONN)
        self.address: tuple[str, int] = (ip, self._listener.getsockname()[1])
        self._store = TCPStore(ip, self.address[1], None, True, wait_for_workers=False, multi_tenant=True,
                               master_listen_fd=self._listener.fileno())

    def close(self) -> None:
        """Stop the store's server and free its port (a reused worker hosts each run's store anew).

        The store owns the listening socket's descriptor and closes it when it goes, so the Python
        socket lets go of it first: closing it twice could close a descriptor reused meanwhile.
        """
        self._listener.detach()
        self._store = None
