"""A single-node launch's rendezvous stores listen on 127.0.0.1 only.

`torchrun --standalone` hosts two c10d TCP stores in the launcher (the rendezvous backend's and
the one the workers bootstrap from, `MASTER_ADDR:MASTER_PORT`), and torch's TCPStore server binds
every interface: anyone who reaches the port can read and write the job's keys. Nothing outside
this machine needs them when all workers are local. So, for a single-node launch, cpctl replaces
`--standalone` with a rendezvous backend of its own, registered in torch's rendezvous registry
under `cpctl-loopback`: the same c10d rendezvous, its stores created on sockets bound to
127.0.0.1 (TCPStore's `master_listen_fd`), and the workers told `MASTER_ADDR=127.0.0.1`.

The dry run still prints `torchrun --standalone ...`, the command that does the same thing
(listening on every interface).
"""

from __future__ import annotations

import socket
import uuid
from datetime import timedelta
from typing import Any

BACKEND = "cpctl-loopback"
LOOPBACK = "127.0.0.1"


def rendezvous_argv(argv: list[str]) -> list[str]:
    """torchrun's argv with `--standalone` replaced by the loopback rendezvous (registered here);
    unchanged when it has no `--standalone` or this torch lacks what the loopback one needs."""
    if "--standalone" not in argv or not register():
        return argv
    at = argv.index("--standalone")
    loopback = [f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={LOOPBACK}:0", f"--rdzv-id={uuid.uuid4()}",
                f"--local-addr={LOOPBACK}"]
    return [*argv[:at], *loopback, *argv[at + 1:]]


def register() -> bool:
    """Register the backend with torch's rendezvous registry (once); False where this torch's
    rendezvous handler has no store-server factory to give loopback sockets to."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    if not hasattr(DynamicRendezvousHandler, "_create_tcp_store_server"):
        return False
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return True


def loopback_store(*, timeout: timedelta) -> Any:
    """A TCPStore server listening on 127.0.0.1 only, on a free port."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    # the store takes the listening socket over (and closes it when it goes)
    return TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=listener.detach())


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous (`create_handler`), with its stores on loopback sockets."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler is the backend asked for
            return BACKEND

    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = loopback_store(timeout=timeout)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store the workers bootstrap from (MASTER_ADDR:MASTER_PORT): a loopback one too.
    handler._create_tcp_store_server = lambda master_addr, master_port: loopback_store(timeout=timeout)
    return handler
