"""A failed launch, told as one error: which worker caused it, what it said, how it ended.

The root cause comes first: a worker's own error before one that only lost its peers, and
those before the workers the agent stopped. Its report (cpctl.failure_report, written by the
worker through cpctl.runtime.process) gives its rank, message and traceback file; cpctl exits
with that worker's own code. torchelastic's own lines about failed workers are dropped while
the workers run: the error says it once.

A worker killed by SIGKILL leaves no report. When host memory runs out, the kernel's
out-of-memory killer is the usual sender, and long-sequence training has its own ways to fill
host memory: offloaded activations (memory.offload_activations) and FSDP's CPU offload
(memory.cpu_offload). The launcher notes the kernel's OOM-kill counters when it starts
(/proc/vmstat, and its cgroup's: v2 memory.events, v1 memory.oom_control) and samples each local
worker's resident memory once a second, so a worker's SIGKILL reads as one line: by the OOM
killer or not, how much memory the worker held, what in the profile puts tensors in host memory,
and `cpctl plan --host-memory` to size it. Torch-free; Linux files only, silently absent elsewhere.

With restarts (`--max-restarts`), torchrun's agent restarts the workers after a failed attempt
and logs that only at INFO, which it does not show. Each such attempt is one line from cpctl
(Restarts): the root cause as above, and the checkpoint the workers resume from. The moment is
torchelastic's own ERROR line for a failed attempt ("failed (exitcode: C) local_rank: L (pid: P)",
the first worker to fail, logged once the others are stopped); the workers' reports are their
error files, at the place torchrun's DefaultLogsSpecs documents (LOG_DIR/RUN_ID/attempt_K/L/
error.json); the checkpoint is the one cpctl's Checkpointer noted (failure_report.CheckpointNote).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cpctl.errors import LaunchError, first_line
from cpctl.failure_report import CheckpointNote, FailureReport

GiB = 2**30
K = TypeVar("K")  # what a mapping of failures is keyed by: the global rank (None where not seen)


def oom_kills() -> int | None:
    """The kernel's OOM kills so far, as this machine and this process's cgroup count them (the
    larger: a cgroup's limit kills count there, and on older kernels not in /proc/vmstat)."""
    counts = [count for count in (_vmstat_oom_kills(), _cgroup_oom_kills()) if count is not None]
    return max(counts) if counts else None


def _vmstat_oom_kills() -> int | None:
    return _field(Path("/proc/vmstat"), "oom_kill")


def _cgroup_oom_kills() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                return _field(Path(f"/sys/fs/cgroup{path}") / "memory.events", "oom_kill")
            if "memory" in controllers.split(","):  # v1
                return _field(Path(f"/sys/fs/cgroup/memory{path}") / "memory.oom_control", "oom_kill")
    return None


def _field(path: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return None


def host_memory_bytes() -> int | None:
    """MemTotal of this machine."""
    value = _field_kib(Path("/proc/meminfo"), "MemTotal:")
    return None if value is None else value * 1024


def machine_host_memory_gib() -> float | None:
    """This machine's memory for `cpctl plan`: MemTotal, or a smaller cgroup limit (a container's)."""
    total = host_memory_bytes()
    limit = _cgroup_limit()
    found = [value for value in (total, limit) if value]
    return min(found) / GiB if found else None


def _cgroup_limit() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                text = (Path(f"/sys/fs/cgroup{path}") / "memory.max").read_text().strip()
                return None if text == "max" else int(text)
            if "memory" in controllers.split(","):
                value = int((Path(f"/sys/fs/cgroup/memory{path}") / "memory.limit_in_bytes").read_text())
                return value if value < 2**60 else None  # v1's "unlimited" is a huge number
    return None


def _field_kib(path: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    return None


def _children(parent: int) -> Iterable[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == parent:  # the field after the state
                    yield int(entry.name)


def _environ_value(pid: int, name: str) -> str | None:
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            key, _, value = item.partition(b"=")
            if key == name.encode():
                return value.decode(errors="replace")
    return None


class MemoryWatch:
    """For one launch: the OOM-kill counter at its start and each local worker's largest resident
    memory seen (sampled every `interval` seconds from a background thread), and its global rank."""

    def __init__(self, *, interval: float = 1.0) -> None:
        self.interval = interval
        self.oom_kills_at_start = oom_kills()
        self.resident: dict[int, int] = {}  # worker pid -> largest RSS seen, bytes
        self.ranks: dict[int, int] = {}  # worker pid -> its RANK (torchrun's, in its environment)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpctl-memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        for pid in _children(os.getpid()):
            rss = _field_kib(Path(f"/proc/{pid}/status"), "VmRSS:")
            if rss is not None:
                self.resident[pid] = max(self.resident.get(pid, 0), rss * 1024)
            if pid not in self.ranks:
                with contextlib.suppress(TypeError, ValueError):
                    self.ranks[pid] = int(_environ_value(pid, "RANK"))  # type: ignore[arg-type]

    def killed_by(self, signal_name: str, *, pid: int, memory: Any) -> str:
        """How a worker that died of `signal_name` was killed, in words (after "was killed by")."""
        oom_now = oom_kills()
        oom = None if oom_now is None or self.oom_kills_at_start is None else oom_now > self.oom_kills_at_start
        return describe_kill(signal_name, oom=oom, resident=self.resident.get(pid), host=host_memory_bytes(),
                             offload=host_memory_options(memory))


def host_memory_options(memory: Any) -> list[str]:
    """The profile's options that keep tensors in host memory, as `key: value`."""
    names = ("offload_activations", "cpu_offload")
    return [f"memory.{name}: true" for name in names if getattr(memory, name, False)]


def describe_kill(signal_name: str, *, oom: bool | None, resident: int | None, host: int | None,
                  offload: list[str]) -> str:
    """`SIGKILL (signal 9) ...`: a SIGKILL named as the OOM killer's when the kernel counted one
    since the launch (`oom`), and what to do about host memory; other signals as they are."""
    number = getattr(signal.Signals, signal_name, None)
    shown = f"{signal_name} (signal {int(number)})" if number is not None else signal_name
    if signal_name != "SIGKILL":
        return shown
    held = f"it held {resident / GiB:.1f} GiB" if resident else "its memory use was not seen"
    machine = f" of this machine's {host / GiB:.1f} GiB" if host else ""
    plan = f"`cpctl plan --model ... --seq-len ... --host-memory {host / GiB:.0f}`" if host else \
        "`cpctl plan --host-memory GIB`"
    if oom:
        options = (f"{' and '.join(offload)} keep{'s' if len(offload) == 1 else ''} tensors in host memory; "
                   if offload else "")
        return (f"{shown} from the kernel's out-of-memory killer: host memory ran out ({held}{machine}); "
                f"{options}{plan} shows what a step needs: use more GPUs (--cp-size), shorter sequences"
                f"{', or turn the offload off' if offload else ', or fewer processes per machine'}")
    if oom is False:
        return (f"{shown}, not by this machine's out-of-memory killer (it counted no kill since the launch; "
                f"{held}): by another process or a scheduler")
    return f"{shown} ({held}{machine}; if host memory ran out, the kernel's out-of-memory killer does this: see dmesg)"


# ----------------------------------------------------------------------------- a worker failed


class WorkerFailure(Protocol):
    """What cpctl reads of torchelastic's ProcessFailure (one per failed worker of ChildFailedError)."""

    @property
    def local_rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def exitcode(self) -> int: ...  # negative: killed by that signal
    @property
    def timestamp(self) -> int: ...  # whole seconds
    @property
    def error_file_data(self) -> object: ...  # the worker's error file, parsed (torchelastic's format)
    @property
    def message(self) -> object: ...  # its message: a str, or the error file's message dict
    def signal_name(self) -> str: ...


def worker_failure(failures: Mapping[int, WorkerFailure], *, killed_by: Callable[..., str] | None = None) -> LaunchError:
    """The root cause, once: its rank and message (from the worker's report), where its traceback
    is, and the exit line. cpctl exits with that worker's own code. A worker killed by a signal is
    named by `killed_by` (MemoryWatch.killed_by: the OOM killer, or not)."""
    rank, failure = root_cause(failures)
    report = FailureReport.from_error_file_data(failure.error_file_data)
    how, exit_code = how_it_ended(failure, report=report, killed_by=killed_by)
    first = None if report is None else report.first  # the rank that failed first, maybe elsewhere
    exit_line = f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
    others = len(failures) - 1
    if others:
        exit_line += f" (and {others} more rank{'s' if others > 1 else ''} after it)"
    if first is None:  # no report: it exited, was killed, or failed before cpctl.init()
        message = _torchelastic_message(failure)
        if message:
            exit_line += f": {message}"
        return LaunchError(exit_line + "; its output is above", exit_code=exit_code)
    return LaunchError(f"rank {first.rank}: {first.summary}\n"
                       f"  traceback: {first.traceback_file}{_elsewhere(first)}\n"
                       f"  {exit_line}", exit_code=exit_code)


def how_it_ended(failure: WorkerFailure, *, report: FailureReport | None,
                 killed_by: Callable[..., str] | None) -> tuple[str, int]:
    """(`exited with code C` or `was killed by ...`, with `stopped after rank F failed` first when its
    report says so; the exit code cpctl passes on for it)."""
    code = failure.exitcode
    if code == -signal.SIGTERM and report is not None:
        # it raised, so was exiting with code 1, when the agent saw a peer gone and stopped it
        how, exit_code = "exited with code 1", 1
    elif code < 0:
        name = failure.signal_name()
        how, exit_code = f"was killed by {killed_by(name, pid=failure.pid) if killed_by else name}", 128 - code
    else:
        how, exit_code = f"exited with code {code}", code or 1
    if report is not None and report.after is not None:
        how = f"stopped after rank {report.after.rank} failed and {how}"
    return how, exit_code


def _elsewhere(report: FailureReport) -> str:
    return f" on {report.host}" if report.host != socket.gethostname() else ""


def _torchelastic_message(failure: WorkerFailure) -> str:
    """The first line of the message a script's torchelastic `@record` wrote; "" when it wrote none."""
    data, message = failure.error_file_data, failure.message
    recorded = isinstance(data, dict) and data.get("message") != "<NONE>"  # torchelastic's "no error file"
    if isinstance(message, dict):
        message = message.get("message", "")
    return first_line(str(message)) if recorded else ""


def root_cause(failures: Mapping[K, WorkerFailure]) -> tuple[K, WorkerFailure]:
    """The failure that caused the others, not just the one with the smallest whole-second
    timestamp (torchelastic's pick): a worker's own error before one that only lost its peers
    (or was told by another rank that it failed first), and those before the workers the agent
    stopped with SIGTERM; then the earliest."""

    def order(item: tuple[int, WorkerFailure]) -> tuple[int, float]:
        _, failure = item
        report = FailureReport.from_error_file_data(failure.error_file_data)
        if report is not None:
            return (2 if report.secondary else 0, report.time)
        stopped = failure.exitcode == -signal.SIGTERM
        return (3 if stopped else 1, float(failure.timestamp))

    return min(failures.items(), key=order)


class _QuietWorkerFailures(logging.Filter):
    """Drops torchelastic's own lines about failed workers: cpctl reports the root cause itself."""

    LINES = {  # logger: what its dropped lines contain
        "torch.distributed.elastic.multiprocessing.api": ("failed (exitcode", "closing signal"),
        # on a node whose peer, the one hosting the rendezvous store, went away first
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous": ("has failed to shutdown the rendezvous",),
        # Ctrl-C: cpctl's own line ("interrupted by SIGINT; workers stopped") is the one the user sees
        "torch.distributed.elastic.agent.server.api": ("death signal, shutting down workers",),
    }

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


@contextlib.contextmanager
def quiet_worker_failures() -> Iterator[None]:
    """torchelastic's loggers without their lines about failed workers, for the `with` block."""
    filters = {logging.getLogger(name): _QuietWorkerFailures(lines) for name, lines in _QuietWorkerFailures.LINES.items()}
    for logger, quiet in filters.items():
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger, quiet in filters.items():
            logger.removeFilter(quiet)


# ----------------------------------------------------------------------------- a restart

_FAILED_ATTEMPT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_FAILED_ATTEMPT = "failed (exitcode"  # its ERROR line for a failed attempt: args exitcode, local_rank, pid, ...


@dataclass(frozen=True)
class _Seen:
    """A worker of a failed attempt as the launcher saw it: a WorkerFailure."""

    local_rank: int
    pid: int
    exitcode: int
    error_file_data: object
    timestamp: int = field(default_factory=lambda: int(time.time()))

    @property
    def message(self) -> object:
        data = self.error_file_data
        return data.get("message", "") if isinstance(data, dict) else ""

    def signal_name(self) -> str:
        with contextlib.suppress(ValueError):
            return signal.Signals(-self.exitcode).name
        return f"signal {-self.exitcode}"


class Restarts(logging.Filter):
    """For one launch with restarts: each failed attempt that torchrun's agent restarts, told on one
    line (`cpctl: restart K of N: CAUSE; CHECKPOINT`) when torchelastic logs the failed attempt.

    The agent restarts after each failed attempt of this node while it has restarts left
    (`--max-restarts`); the attempt after the last is the launch's error (worker_failure).
    A restart because another node's workers failed is told on that node."""

    def __init__(self, *, max_restarts: int, logs: Path, error_dir: Path, nnodes: int,
                 ranks: Mapping[int, int], killed_by: Callable[..., str] | None = None) -> None:
        super().__init__()
        self.max_restarts = max_restarts
        self.logs = logs  # torchrun's --log-dir
        self.error_dir = error_dir  # the launch's: the Checkpointer's note
        self.nnodes = nnodes
        self.ranks = ranks  # worker pid -> global rank (MemoryWatch.ranks)
        self.killed_by = killed_by
        self.failed_attempts = 0
        self.lines: list[str] = []

    def __enter__(self) -> Restarts:
        # before quiet_worker_failures' filter, which drops the record this one reads
        logging.getLogger(_FAILED_ATTEMPT_LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        logging.getLogger(_FAILED_ATTEMPT_LOGGER).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if _FAILED_ATTEMPT in str(record.msg) and isinstance(args, tuple) and len(args) >= 3:
            try:
                self.attempt_failed(exitcode=int(args[0]), local_rank=int(args[1]), pid=int(args[2]))
            except Exception as exc:  # noqa: BLE001 - the line is a courtesy: never break the agent's loop
                print(f"cpctl: a restart could not be described ({type(exc).__name__}: {exc})",
                      file=sys.stderr, flush=True)
        return True

    def attempt_failed(self, *, exitcode: int, local_rank: int, pid: int) -> None:
        """Attempt `failed_attempts` (torchrun's restart count) ended: the first worker to fail was
        local rank `local_rank`; say why, unless it was the last attempt."""
        attempt = self.failed_attempts
        self.failed_attempts += 1
        if self.failed_attempts > self.max_restarts:
            return
        reports = self.error_files(attempt)
        first = _Seen(local_rank=local_rank, pid=pid, exitcode=exitcode,
                      error_file_data=reports.get(local_rank, {"message": "<NONE>"}))
        rank = self.ranks.get(pid, local_rank if self.nnodes == 1 else None)
        seen: dict[int | None, WorkerFailure] = {rank: first}  # None: its global rank was not seen
        for other, data in reports.items():  # the others that wrote a report: they raised
            report = FailureReport.from_error_file_data(data)
            if other != local_rank and report is not None:
                seen[report.rank] = _Seen(local_rank=other, pid=0, exitcode=1, error_file_data=data)
        cause = restart_cause(seen, killed_by=self.killed_by)
        lost = FailureReport.from_error_file_data(first.error_file_data)
        silent = self.without_report(attempt, reports) if lost is not None and lost.secondary else []
        if silent:  # torchelastic saw a rank that lost its peer first; the peer itself died without a word
            who = ", ".join(f"rank {r}" if self.nnodes == 1 else f"local rank {r}" for r in silent)
            cause = (f"{who} ended without a report, so by a signal (SIGKILL, or the kernel's OOM killer when host "
                     f"memory ran out); then {cause}")
        line = (f"restart {self.failed_attempts} of {self.max_restarts}: "
                f"{cause}; {resumes_from(CheckpointNote.read(self.error_dir))}")
        self.lines.append(line)
        print(f"cpctl: {line}", file=sys.stderr, flush=True)

    def without_report(self, attempt: int, reports: Mapping[int, object]) -> list[int]:
        """The local ranks of `attempt` that left no error file (torchelastic makes a folder per local rank)."""
        ranks = {int(path.name) for path in self.logs.glob(f"*/attempt_{attempt}/*") if path.name.isdigit()}
        return sorted(ranks - set(reports))

    def error_files(self, attempt: int) -> dict[int, object]:
        """Local rank -> its error file of `attempt`, parsed (torchelastic's format), where one was written."""
        found: dict[int, object] = {}
        for path in self.logs.glob(f"*/attempt_{attempt}/*/error.json"):
            with contextlib.suppress(OSError, ValueError):
                found[int(path.parent.name)] = json.loads(path.read_text())
        return found


def restart_cause(failures: Mapping[int | None, WorkerFailure], *, killed_by: Callable[..., str] | None = None) -> str:
    """Why an attempt failed, in one clause: the root cause's report (`rank R failed: SUMMARY
    (traceback: FILE)`), or how its worker ended (`rank R (pid P) was killed by SIGKILL ...`)."""
    rank, failure = root_cause(failures)
    report = FailureReport.from_error_file_data(failure.error_file_data)
    if report is not None:
        first = report.first
        return f"rank {first.rank} failed: {first.summary} (traceback: {first.traceback_file}{_elsewhere(first)})"
    how, _ = how_it_ended(failure, report=None, killed_by=killed_by)
    who = f"rank {rank}" if rank is not None else f"local rank {failure.local_rank}"
    message = _torchelastic_message(failure)
    return f"{who} (pid {failure.pid}) {how}{': ' + message if message else ''}"


def resumes_from(note: CheckpointNote | None) -> str:
    """Which checkpoint the restarted workers resume from, as the Checkpointer noted it."""
    if note is None:
        return "no checkpoint saved or loaded through cpctl.Checkpointer yet"
    if not Path(note.path).is_dir():
        return f"the newest checkpoint the workers noted, {note.path}, is gone"
    return f"load_latest resumes from checkpoint step {note.step} at {note.path}"
