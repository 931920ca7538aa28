"""The process group's life: started once per process, torn down cleanly at exit.

It also decides what an uncaught exception in a worker looks like. Under `cpctl launch`
(ERROR_DIR_ENV_VAR set by the launcher) the worker prints nothing: it writes the full traceback
to ERROR_DIR/rank{R}-traceback.txt and its report (cpctl.failure_report: a one-line summary) to
torchelastic's error file (TORCHELASTIC_ERROR_FILE, the file `@record` writes), from which the launcher prints the root
cause once; a worker prints one line itself only when torchrun is about to restart the workers.
The first rank to fail claims a key in the c10d store, so a peer that fails after it (typically
with gloo's "Connection closed by peer") knows its own failure is secondary. Elsewhere (plain
torchrun, python) Python's usual traceback is printed.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist

from cpctl.errors import CpctlError, first_line
from cpctl.failure_report import ERROR_DIR_ENV_VAR, FailureReport, traceback_path

_PREFIX_TEMPLATE_ENV_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
_FIRST_FAILURE_KEY = "cpctl/first_failure"  # in the default c10d store: which rank failed first
_STORE_TIMEOUT = datetime.timedelta(seconds=5)  # a dead store must not hold a failing worker
# An exception with one of these in its message most likely reports a peer that went away.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "connection refused", "broken pipe",
              "remote process exited", "communicator was aborted")

_FAILED = False  # an exception ended the script: peers may never reach the exit barrier
# ... one other than Ctrl-C, with peers: the process exits at once, its groups left as they are
_LEAVE_AT_ONCE = False
_EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=30)


def start(device: torch.device, *, on_exit: Callable[[], None], timeout_s: int) -> None:
    """nccl on cuda, gloo on cpu; under a launcher its rendezvous, else a world of one.

    Every collective of every group waits at most `timeout_s` (the profile's comm_timeout); the
    default group's store is namespaced per torchrun attempt, so a restarted worker never reads
    the addresses its dead predecessors left there.
    """
    _die_with_the_launcher()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    hook = _ExceptHook(sys.excepthook)
    try:
        if "RANK" in os.environ:
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"cpctl/attempt{attempt}", store), rank=rank,
                                    world_size=world, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    except BaseException:
        sys.excepthook = hook  # a failure to connect is reported as any other
        raise
    # init_process_group wraps sys.excepthook to prefix each line with "[rankN]: "; where torchrun
    # prefixes every line already (cpctl launch sets its template), that doubled the prefix.
    hook.torch = sys.excepthook
    sys.excepthook = hook
    atexit.register(_shutdown, on_exit)
    global _COMM_TIMEOUT
    _COMM_TIMEOUT = timeout


_COMM_TIMEOUT = datetime.timedelta(minutes=30)


def comm_timeout_s() -> float:
    """How long a collective waits for its peers (the profile's comm_timeout)."""
    return _COMM_TIMEOUT.total_seconds()


def apply_timeout(groups: list[dist.ProcessGroup]) -> None:
    """The comm timeout on groups made after start (a DeviceMesh's sub-groups take torch's default)."""
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(_COMM_TIMEOUT, group)


def _die_with_the_launcher() -> None:
    """A worker of `cpctl launch` ends when its launcher does, even by SIGKILL (the OOM killer, a
    scheduler): otherwise it would move to PID 1 and keep training, and keep its GPU memory."""
    if not os.environ.get(ERROR_DIR_ENV_VAR) or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills this process when its parent dies
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class _ExceptHook:
    """sys.excepthook of a cpctl worker: notes the failure (no exit barrier), then reports it."""

    def __init__(self, original: Callable[..., object]) -> None:
        self.original = original  # the hook before torch's
        self.torch: Callable[..., object] | None = None  # torch's prefixing wrapper of it

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _FAILED, _LEAVE_AT_ONCE
        _FAILED = True
        # Ctrl-C, and any failure of a process alone, ends as Python ends it (atexit handlers, the
        # script's open files flushed): only peers mid-collective make the teardown abort.
        _LEAVE_AT_ONCE = not issubclass(exc_type, KeyboardInterrupt) and _has_peers()
        if not os.environ.get(ERROR_DIR_ENV_VAR):  # not under cpctl launch: Python's traceback
            prefixed = _PREFIX_TEMPLATE_ENV_VAR in os.environ or self.torch is None
            (self.original if prefixed else self.torch)(exc_type, exc, tb)
            return
        if issubclass(exc_type, KeyboardInterrupt):
            return  # Ctrl-C: the launcher says so once, for every worker
        try:
            report_failure(exc, tb)
        except Exception:  # never lose the error to a bug in the report
            self.original(exc_type, exc, tb)


def summary(exc: BaseException) -> str:
    """One line: a CpctlError's own message; for anything else its type and first line."""
    if isinstance(exc, CpctlError):
        return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    kind = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__"):
        kind = f"{module}.{kind}"
    first = first_line(str(exc))
    return f"{kind}: {first}" if first else kind


def _has_peers() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def report_failure(exc: BaseException, tb: TracebackType | None) -> None:
    """Write this rank's traceback and error file; print one line only if torchrun will restart."""
    rank = int(os.environ.get("RANK", "0"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restarts_left = restarts - attempt
    path = traceback_path(Path(os.environ[ERROR_DIR_ENV_VAR]), rank=rank, attempt=attempt, restarts=restarts)
    path.parent.mkdir(parents=True, exist_ok=True)
    traceback_text = "".join(traceback.format_exception(type(exc), exc, tb))
    path.write_text(traceback_text)
    report = FailureReport(rank=rank, host=socket.gethostname(), summary=summary(exc) + _who_stopped_answering(exc),
                           traceback_file=str(path), time=time.time(), peer_lost=_looks_like_a_lost_peer(exc))
    report = dataclasses.replace(report, after=_claim_first_failure(report))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        raise RuntimeError("no TORCHELASTIC_ERROR_FILE: the launcher would not see the report")
    Path(error_file).write_text(report.error_file_json(traceback_text=traceback_text))
    if restarts_left > 0 and report.after is None:  # the launcher reports only the last attempt
        print(f"failed: {report.summary} (traceback: {path}); torchrun restarts the workers "
              f"({restarts_left} restart{'s' if restarts_left > 1 else ''} left)", file=sys.stderr, flush=True)


def _who_stopped_answering(exc: BaseException) -> str:
    """After a collective timed out: which ranks stopped answering.

    Every rank whose collective times out checks in at the store; the ranks that have not
    checked in after a few seconds are the ones stuck elsewhere (or dead). The store, not a
    collective: the group itself may be broken after the timeout, and the stuck rank would
    never join a new one.
    """
    text = str(exc).lower()
    if ("timed out" not in text and "timeout" not in text) or not _has_peers():
        return ""
    waited = f"after {_COMM_TIMEOUT.total_seconds():.0f} s"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)
        store.set(f"cpctl/timed_out/{dist.get_rank()}", "1")
        world = dist.get_world_size()
        deadline = time.monotonic() + _CHECK_IN_SECONDS
        while True:
            silent = [r for r in range(world) if not store.check([f"cpctl/timed_out/{r}"])]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - no store to ask: say what is known
        return f" ({waited})"
    if not silent:
        return f" ({waited}; every rank timed out: a rank outside this group, or a slow collective)"
    names = ", ".join(map(str, silent))
    return f" ({waited}; rank{'s' if len(silent) > 1 else ''} {names} stopped answering)"


_CHECK_IN_SECONDS = 5.0  # how long the ranks whose collective timed out wait for each other


def _looks_like_a_lost_peer(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return any(fragment in text for fragment in _PEER_LOST)


def _claim_first_failure(report: FailureReport) -> FailureReport | None:
    """Record this rank as the first to fail, unless another was: then return that one's report."""
    if not _has_peers():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)
        first = FailureReport.from_json(store.compare_set(_FIRST_FAILURE_KEY, "", report.to_json()))
    except Exception:  # no store, a dead store: count this failure as a first one
        return None
    return None if first is None or first.rank == report.rank else first


def _shutdown(on_exit: Callable[[], None]) -> None:
    """Tear the process groups down while Python is fully alive.

    gloo's worker threads may still hold the tensors of finished collectives; if they free them
    during interpreter finalization, the thread is killed mid-destructor and the process aborts
    ("terminate called without an active exception", exit 134). A barrier first lets every
    rank's threads go idle and no rank close connections a peer still uses; collecting garbage
    after destroy_process_group frees the groups FSDP's and the mesh's reference cycles hold.
    """
    on_exit()
    if _LEAVE_AT_ONCE:
        # A failed rank leaves now, with Python's exit code for an uncaught exception, without
        # tearing the process group down: its peers may be mid-collective, and gloo's threads then
        # abort the process in teardown (SIGABRT, exit 134), which the launcher would report in
        # place of the error (seen on the 2-core CI machine); NCCL's destroy could wait on them.
        logging.shutdown()  # what its own exit handler would flush
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
    close_process_group()


def close_process_group() -> None:
    """The teardown `_shutdown` does, for a framework that destroys the process group itself
    (accelerate's `end_training`): the same abort would follow its bare destroy."""
    if not dist.is_initialized():
        return
    if not _FAILED and dist.get_backend() == "gloo":  # at world 1 too: its threads go idle before the destroy
        with contextlib.suppress(RuntimeError):  # a peer that never arrives must not hold this rank
            dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
    dist.destroy_process_group()
    gc.collect()
