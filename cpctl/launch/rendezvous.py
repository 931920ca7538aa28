"""Several nodes meeting at the c10d rendezvous: this node's wait shown, and its failure told.

While this node waits for the others, a line on stderr when it starts, then after
FIRST_REPORT_S and every REPORT_EVERY_S seconds until all joined. The nodes that joined are
read from the c10d rendezvous state in the endpoint's store (a client of its own, from a
background thread); when that state cannot be read the lines say what is expected, without a
count. A rendezvous that fails, or a Ctrl-C during the wait, is one error naming the fix.
Torch is imported only inside the watch's thread.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from cpctl.errors import LaunchError, first_line

if TYPE_CHECKING:
    from torch.distributed import TCPStore

_NO_RENDEZVOUS_STATE = b"Y2FuaW1hZGFt"  # C10dRendezvousBackend's value before any node joined


class RendezvousWatch:
    """For one launch of several nodes: what this node saw of the rendezvous while it waited."""

    FIRST_REPORT_S = 5.0
    REPORT_EVERY_S = 30.0
    POLL_S = 1.0

    def __init__(self, *, endpoint: str, run_id: str, rdzv_conf: str, nnodes: int) -> None:
        self.endpoint = endpoint  # HOST:PORT of the rendezvous store (torchrun's --rdzv-endpoint)
        self.nnodes = nnodes
        self.key = f"torch.rendezvous.{run_id}"  # C10dRendezvousBackend's key of the rendezvous state
        self.timeout_s = join_timeout(rdzv_conf)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpctl-rendezvous-watch", daemon=True)
        self._store: TCPStore | None = None
        self.joined: int | None = None  # nodes in the rendezvous when last read
        self.complete = False  # whether all had joined then

    def __enter__(self) -> RendezvousWatch:
        self._say(f"rendezvous at {self.endpoint}: waiting for {self.nnodes} nodes "
                  f"(this one included; gives up after {self.timeout_s} s)")
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._store = None  # its connection to the endpoint

    def _say(self, text: str) -> None:
        print(f"cpctl: {text}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        started = time.monotonic()
        report_at = started + self.FIRST_REPORT_S
        reported = False
        while not self._stop.wait(self.POLL_S):
            joined, complete = self.state()
            if joined is not None:
                self.joined, self.complete = joined, complete
            elapsed = round(time.monotonic() - started)
            if complete:
                if reported:
                    self._say(f"all {self.nnodes} nodes joined after {elapsed} s")
                return
            if time.monotonic() < report_at or self._stop.is_set():
                continue
            count = f"{self.nnodes} nodes expected" if joined is None else f"{joined} of {self.nnodes} nodes joined"
            hint = "" if reported else ("; run `cpctl launch` on every node with the same --nnodes and --rdzv-endpoint, "
                                        "each with its own --node-rank")
            self._say(f"still waiting at {self.endpoint}: {count} after {elapsed} s "
                      f"(gives up after {self.timeout_s} s{hint})")
            reported = True
            report_at += self.REPORT_EVERY_S

    def state(self) -> tuple[int | None, bool]:
        """(nodes joined, rendezvous complete) from the endpoint's store; (None, False) if unknown."""
        try:
            import base64
            import pickle
            from datetime import timedelta

            from torch.distributed import TCPStore

            if self._store is None:
                host, _, port = self.endpoint.rpartition(":")
                self._store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2),
                                       wait_for_workers=False)
            store = self._store
            if not store.check([self.key]):
                return 0, False
            value = store.get(self.key)
            if value == _NO_RENDEZVOUS_STATE:
                return 0, False
            state = pickle.loads(base64.b64decode(value))  # what C10dRendezvousBackend.get_state decodes
            return len(state.participants), bool(state.complete)
        except Exception:  # not reachable yet, or a state this version does not know how to read
            return None, False

    def interrupted(self) -> LaunchError | None:
        """Ctrl-C while this node still waited for the others: no worker was started."""
        if self.joined is None or self.complete:
            return None
        return LaunchError(f"interrupted while waiting at the rendezvous ({self.joined} of {self.nnodes} nodes "
                           "joined); no worker was started", exit_code=128 + signal.SIGINT)


def failed(exc: BaseException, *, watch: RendezvousWatch | None) -> LaunchError:
    """torch's RendezvousError, as one line: what torch said, how many nodes joined, the fix."""
    seen = "" if watch is None or watch.joined is None else f" ({watch.joined} of {watch.nnodes} nodes joined)"
    return LaunchError(
        f"rendezvous failed: {first_line(str(exc)) or type(exc).__name__}{seen}; check that every node runs "
        "`cpctl launch` with the same --nnodes and --rdzv-endpoint and can reach that host:port, where the node "
        "with --node-rank 0 hosts the rendezvous",
        exit_code=1,
    )


def join_timeout(rdzv_conf: str) -> int:
    """Seconds a node waits for the others: --rdzv-conf join_timeout, else torch's default."""
    settings = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    if settings.get("join_timeout", "").strip().isdigit():
        return int(settings["join_timeout"])
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            RendezvousTimeout,
        )

        return round(RendezvousTimeout().join.total_seconds())
    except Exception:
        return 600
