"""Several nodes meeting at the c10d rendezvous: ranks in node-rank order, this node's wait
shown, and its failure told.

Ranks: torch's c10d rendezvous numbers the machines itself, sorted by (host name, agent pid),
so global rank 0, the rank that writes checkpoints, saved models and logs, could run on any
machine. cpctl registers the same c10d rendezvous under `cpctl-c10d` with one step added: once
all machines joined, each writes the node rank it was given (`--node-rank`, CPCTL_NODE_RANK,
SLURM, an accelerate config's machine_rank) to the rendezvous store and reads the others',
and takes its own as its place; a machine given none takes the lowest free place, in c10d's
order. So node rank R runs global ranks R * nproc_per_node onwards, as with torchrun's static
rendezvous, while c10d's rendezvous (its restarts, its state read by the watch) stays.

While this node waits for the others, a line on stderr when it starts, then after
FIRST_REPORT_S and every REPORT_EVERY_S seconds until all joined. The nodes that joined are
read from the c10d rendezvous state in the endpoint's store (a client of its own, from a
background thread); when that state cannot be read the lines say what is expected, without a
count. A rendezvous that fails, or a Ctrl-C during the wait, is one error naming the fix.
Torch is imported only inside the watch's thread and the rendezvous handler.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cpctl.errors import CpctlError, LaunchError, first_line

if TYPE_CHECKING:
    from torch.distributed import TCPStore

BACKEND = "cpctl-c10d"  # c10d's rendezvous, the machines placed by their node ranks
NODE_RANK_CONF = "node_rank"  # this machine's given node rank, in --rdzv-conf (read by the handler only)
_NODE_RANK_KEY = "cpctl.node_rank."  # + the machine's place in c10d's order, in the round's store: its given node rank


def rendezvous_argv(argv: list[str], *, node_rank: int | None) -> list[str]:
    """torchrun's argv with its c10d rendezvous replaced by cpctl's (registered here), told this
    machine's node rank (None: not given); unchanged without c10d, or where this torch's
    rendezvous handler lacks what cpctl's needs (then c10d's order holds: a note says so)."""
    if "--rdzv-backend=c10d" not in argv:
        return argv
    if not register():
        if node_rank is not None:
            print("cpctl: note: this torch's c10d rendezvous cannot be ordered by node rank; global rank 0 runs on "
                  "the machine c10d sorts first (by host name), not necessarily on node rank 0", file=sys.stderr,
                  flush=True)
        return argv
    conf = [] if node_rank is None else [f"{NODE_RANK_CONF}={node_rank}"]
    out = [f"--rdzv-backend={BACKEND}" if arg == "--rdzv-backend=c10d" else arg for arg in argv]
    given = [at for at, arg in enumerate(out) if arg.startswith("--rdzv-conf=")]
    if given:
        out[given[0]] = ",".join([out[given[0]], *conf])
    elif conf:
        out.insert(out.index(f"--rdzv-backend={BACKEND}") + 1, f"--rdzv-conf={conf[0]}")
    return out


def places(given: Sequence[int | None]) -> list[int]:
    """Each machine's place (its group rank), the machines in c10d's order: the node rank it was
    given; a machine given none, the lowest place no machine was given, in c10d's order.
    Raises CpctlError when two machines were given one node rank, or one beyond the machines."""
    machines = len(given)
    for rank in given:
        if rank is not None and not 0 <= rank < machines:
            raise CpctlError(f"a machine was given node rank {rank}, but {machines} machines joined; give each machine "
                             f"its own --node-rank, 0 to {machines - 1}")
    named = [rank for rank in given if rank is not None]
    twice = sorted({rank for rank in named if named.count(rank) > 1})
    if twice:
        raise CpctlError(f"node rank {twice[0]} was given to {named.count(twice[0])} machines; give each machine its "
                         f"own --node-rank, 0 to {machines - 1}")
    free = iter(sorted(set(range(machines)) - set(named)))
    return [next(free) if rank is None else rank for rank in given]


def register() -> bool:
    """Register cpctl's c10d rendezvous with torch's registry (once); False where this torch's
    handler lacks the two steps it builds on (`_get_world`, `_get_store`)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    if not all(hasattr(DynamicRendezvousHandler, name) for name in ("_get_world", "_get_store")):
        return False
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return True


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous (`create_backend`, `create_handler`), each machine placed by its node rank.

    The place is decided in the handler's `_get_world`, which `next_rendezvous` asks before it
    builds anything on the rank: so node rank 0 also hosts the store the workers bootstrap from
    (MASTER_ADDR:MASTER_PORT), as c10d's rank 0 does."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
        create_backend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class RankedBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler is the backend asked for
            return BACKEND

    node_rank = params.get_as_int(NODE_RANK_CONF)
    _, store = create_backend(params)  # c10d's store, hosted where is_host says
    handler = create_handler(store, RankedBackend(store, params.run_id), params)
    c10d_world = handler._get_world

    def world() -> tuple[int, int]:
        place, machines = c10d_world()
        round_store = handler._get_store()  # this round's keys: a restart's round asks again
        round_store.set(f"{_NODE_RANK_KEY}{place}", "" if node_rank is None else str(node_rank))
        try:
            said = [round_store.get(f"{_NODE_RANK_KEY}{other}").decode() for other in range(machines)]
            return places([int(text) if text else None for text in said])[place], machines
        except DistStoreError:
            error = CpctlError(f"a machine did not say its node rank within {params.get_as_int('read_timeout', 60)} s "
                               "of joining; run `cpctl launch` on every machine (a plain torchrun cannot join a "
                               "cpctl launch's rendezvous)")
        except CpctlError as exc:
            error = exc
        raise RendezvousError(str(error)) from error

    handler._get_world = world
    return handler

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
    if isinstance(exc.__cause__, CpctlError):  # cpctl's rendezvous said what is wrong, and its fix
        return LaunchError(f"rendezvous failed: {exc.__cause__}", exit_code=1)
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
