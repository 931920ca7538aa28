"""Profile -> torchrun argv -> `torch.distributed.run`, PyTorch's own elastic agent.

cpctl does what accelerate does: it builds the argv that `torchrun` would be given and hands
it to `torch.distributed.run.run(get_args_parser().parse_args(argv))`. Standalone rendezvous,
c10d rendezvous across nodes, signal forwarding and root-cause reports all come from
torchrun itself. Building a `LaunchConfig` by hand is avoided on purpose: its defaults
(rdzv_backend etcd, max_restarts 3) are not torchrun's, and `--standalone` lives in `run()`.

The resolved profile reaches the workers as JSON in `CPCTL_RESOLVED_PROFILE` (workers inherit
the launcher's environment); torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... as usual.

Only `launch()` imports torch; `prepare()` (and so `cpctl launch --dry-run`) does not.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpctl.config import PROFILE_ENV_VAR, Profile, Resolved
from cpctl.errors import ERROR_DIR_ENV_VAR, REPORT_KEY, CpctlError
from cpctl import versions
from cpctl.launch import loopback
from cpctl.launch.failures import MemoryWatch
from cpctl.launch.accelerate_env import accelerate_env

# torchrun reads the per-line prefix template of tee'd worker output from this variable.
LOG_PREFIX_ENV_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LOG_PREFIX = "[rank${rank}]: "
TEE_ALL = "3"  # stdout and stderr of every local rank, to console (prefixed) and to log files
ACCELERATE_SHIM = "cpctl.integrations.accelerate_shim"  # each worker's entry point for an accelerate script


class LaunchError(CpctlError):
    """The workers ran and failed, or the launch was interrupted: carries the exit code to use."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Plan:
    """Everything one `cpctl launch` will do, computed before anything is spawned."""

    resolved: Resolved
    target: str  # a script path, or a module name when `module`
    target_args: tuple[str, ...]
    module: bool
    torchrun_args: tuple[str, ...]  # what torchrun's own parser is given
    env: dict[str, str]  # set in the launcher's environment; workers inherit it

    def command_line(self) -> str:
        """The equivalent shell command: env assignments, then `torchrun ...`."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join([*assignments, "torchrun", shlex.join(self.torchrun_args)])


def torchrun_args(profile: Profile, *, target: str, target_args: Sequence[str], module: bool) -> list[str]:
    """The torchrun argv for a resolved profile (every value explicit: no torchrun default is relied on)."""
    launch = profile.launch
    argv = [
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
    ]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        argv.append("--standalone")  # a private c10d store on a free local port
    else:
        # No --node-rank: c10d numbers the machines itself when they join (sorted by host name);
        # torchrun honours --node-rank only for its static backend and warns that it ignores it.
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}"]
    argv.append(f"--tee={TEE_ALL}")  # tee'd output is what torchrun prefixes with the rank
    # `--` ends torchrun's options: its parser would otherwise read the script's own options
    # (`--log` as an abbreviation of its --log-dir, `--nnodes` as its own).
    if profile.launch.script_api == "accelerate":
        # cpctl's steps go in front of accelerate's first, then the script runs (cpctl.integrations.accelerate_shim).
        return [*argv, "--module", "--", ACCELERATE_SHIM, *(["-m"] if module else []), target, *target_args]
    if module:
        argv.append("--module")
    return [*argv, "--", target, *target_args]


def worker_env(profile: Profile, *, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the launcher sets for its workers."""
    env = {PROFILE_ENV_VAR: json.dumps(profile.to_dict(), separators=(",", ":")), **accelerate_env(profile)}
    if LOG_PREFIX_ENV_VAR not in environ:  # a user's own template wins
        env[LOG_PREFIX_ENV_VAR] = LOG_PREFIX
    if "OMP_NUM_THREADS" not in environ and profile.launch.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun would set, without its banner
    return env


def prepare(
    resolved: Resolved,
    *,
    target: str,
    target_args: Sequence[str] = (),
    module: bool = False,
    cwd: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Check what the profile cannot (the script or module, the torch install) and plan the launch."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    environ = os.environ if environ is None else environ
    if module:
        _check_module(target, cwd=cwd)
    else:
        _check_script(target, cwd=cwd)
    versions.require_torch()
    profile = resolved.profile
    return Plan(
        resolved=resolved,
        target=target,
        target_args=tuple(target_args),
        module=module,
        torchrun_args=tuple(torchrun_args(profile, target=target, target_args=target_args, module=module)),
        env=worker_env(profile, environ=environ),
    )


def launch(plan: Plan) -> None:
    """Run the workers through torchrun's elastic agent; return when all succeeded.

    Raises LaunchError with the exit code to use: the root-cause rank's own code when a worker
    fails (torchrun itself would exit 1), 128 + signal when interrupted (130 for Ctrl-C).
    Raises CpctlError, before spawning anything, when torch cannot see the GPUs the profile needs.
    """
    profile = plan.resolved.profile
    if profile.launch.device == "cuda":
        import torch

        check_cuda_devices(profile.launch.nproc_per_node, device_count=torch.cuda.device_count(), environ=os.environ)
    # One directory per launch: each worker writes its traceback here when it fails (see
    # cpctl.runtime.process), and torchrun its logs (else it leaves a torchelastic_* directory in /tmp
    # every time). Removed after a launch that went well; kept, and named, after a failure.
    error_dir = Path(tempfile.mkdtemp(prefix="cpctl-"))
    logs = error_dir / "torchrun"
    argv = [f"--log-dir={logs}", *plan.torchrun_args]
    try:
        with _environ({**plan.env, ERROR_DIR_ENV_VAR: str(error_dir)}), MemoryWatch() as memory:
            _run_torchrun(argv, nnodes=profile.launch.nnodes,
                          killed_by=functools.partial(memory.killed_by, memory=profile.memory))
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent installed its own handlers
        raise LaunchError("interrupted; workers stopped", exit_code=128 + signal.SIGINT) from None
    finally:
        # Whatever ended the launch, only the workers' traceback files stay (the error names
        # them); torchrun's logs repeat what the console showed.
        shutil.rmtree(logs, ignore_errors=True)
        if not any(error_dir.glob("*traceback*.txt")):
            shutil.rmtree(error_dir, ignore_errors=True)


def check_cuda_devices(nproc_per_node: int, *, device_count: int, environ: Mapping[str, str]) -> None:
    """torch must see a GPU for every local worker. The profile counted GPUs without torch (from
    CUDA_VISIBLE_DEVICES, or the driver), so a variable naming GPUs that do not exist passes it."""
    if device_count >= nproc_per_node:
        return
    sees = f"torch sees {device_count} GPU{'' if device_count == 1 else 's'}" if device_count else "torch sees no GPU"
    fix = f"--nproc-per-node {device_count}" if device_count else "--device cpu"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        named = len([item for item in visible.split(",") if item.strip()])
        raise CpctlError(
            f"CUDA_VISIBLE_DEVICES={visible} names {named} GPU{'' if named == 1 else 's'} but {sees} (nproc_per_node "
            f"{nproc_per_node}): CUDA drops the first entry that is no GPU of this machine and every one after it; "
            f"set CUDA_VISIBLE_DEVICES to GPUs that exist (`nvidia-smi -L` lists them), unset it, or pass {fix}"
        )
    raise CpctlError(f"{sees} but nproc_per_node is {nproc_per_node}; check `nvidia-smi` and that torch is a CUDA "
                     f"build (torch.version.cuda), or pass {fix}")


def _run_torchrun(argv: list[str], *, nnodes: int = 1, killed_by: Callable[..., str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.get_args_parser().parse_args(loopback.rendezvous_argv(argv))
    watch = _RendezvousWatch(args, nnodes=nnodes) if nnodes > 1 else contextlib.nullcontext()
    try:
        with _quiet_worker_failures(), _single_rank_prefix(), watch:
            torchrun.run(args)
    except ChildFailedError as exc:
        raise _worker_failure(exc, killed_by=killed_by) from None
    except SignalException as exc:
        # the agent has already stopped the workers when this reaches us
        raise LaunchError(f"interrupted by {exc.sigval.name}; workers stopped", exit_code=128 + int(exc.sigval)) from None
    except KeyboardInterrupt:
        if isinstance(watch, _RendezvousWatch) and watch.joined is not None and not watch.complete:
            raise LaunchError(f"interrupted while waiting at the rendezvous ({watch.joined} of {nnodes} nodes joined); "
                              "no worker was started", exit_code=128 + signal.SIGINT) from None
        raise
    except RendezvousError as exc:
        joined = getattr(watch, "joined", None)
        seen = f" ({joined} of {nnodes} nodes joined)" if joined is not None else ""
        raise LaunchError(
            f"rendezvous failed: {_first_line(str(exc)) or type(exc).__name__}{seen}; check that every node runs "
            "`cpctl launch` with the same --nnodes and --rdzv-endpoint and can reach that host:port",
            exit_code=1,
        ) from None


# ----------------------------------------------------------------------------- a worker failed


def _worker_failure(exc: object, *, killed_by: Callable[..., str] | None = None) -> LaunchError:
    """The root cause, once: its rank and message (from the worker's report, see cpctl.runtime.process),
    where its traceback is, and the exit line. cpctl exits with that worker's own code. A worker
    killed by a signal is named by `killed_by` (launch/failures.py: the OOM killer, or not)."""
    failures = exc.failures  # type: ignore[attr-defined]
    rank, failure = _root_cause(failures)
    report = _report(failure)
    code = failure.exitcode
    if code == -signal.SIGTERM and report is not None:
        # it raised, so was exiting with code 1, when the agent saw a peer gone and stopped it
        how, exit_code = "exited with code 1", 1
    elif code < 0:
        name = failure.signal_name()
        how, exit_code = f"was killed by {killed_by(name, pid=failure.pid) if killed_by else name}", 128 - code
    else:
        how, exit_code = f"exited with code {code}", code or 1
    first = None if report is None else report.get("after") or report  # the rank that failed first, maybe elsewhere
    if first is not None and first is not report:
        how = f"stopped after rank {first['rank']} failed and {how}"
    exit_line = f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
    others = len(failures) - 1
    if others:
        exit_line += f" (and {others} more rank{'s' if others > 1 else ''} after it)"
    if first is None:  # no report: it exited, was killed, or failed before cpctl.init()
        recorded = failure.error_file_data.get("message") != "<NONE>"  # the script used torchelastic's @record
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        if recorded and _first_line(message):
            exit_line += f": {_first_line(message)}"
        return LaunchError(exit_line + "; its output is above", exit_code=exit_code)
    where = f" on {first['host']}" if first.get("host") not in (None, socket.gethostname()) else ""
    return LaunchError(f"rank {first['rank']}: {first['summary']}\n"
                       f"  traceback: {first['traceback_file']}{where}\n"
                       f"  {exit_line}", exit_code=exit_code)


def _report(failure: object) -> dict | None:
    data = getattr(failure, "error_file_data", None)
    report = data.get(REPORT_KEY) if isinstance(data, dict) else None
    return report if isinstance(report, dict) and {"rank", "summary", "traceback_file"} <= report.keys() else None


def _root_cause(failures: Mapping[int, object]) -> tuple[int, object]:
    """The failure that caused the others, not just the one with the smallest whole-second
    timestamp (torchelastic's pick): a worker's own error before one that only lost its peers
    (or was told by another rank that it failed first), and those before the workers the agent
    stopped with SIGTERM; then the earliest."""

    def order(item: tuple[int, object]) -> tuple[int, float]:
        _, failure = item
        report = _report(failure)
        if report is not None:
            secondary = bool(report.get("after") or report.get("peer_lost"))
            return (2 if secondary else 0, float(report.get("time", failure.timestamp)))  # type: ignore[attr-defined]
        stopped = failure.exitcode == -signal.SIGTERM  # type: ignore[attr-defined]
        return (3 if stopped else 1, float(failure.timestamp))  # type: ignore[attr-defined]

    return min(failures.items(), key=order)


class _SinglePrefix:
    """A console stream that writes a doubled rank prefix once. In a worker that started
    torch.distributed itself (not through cpctl.init: accelerate, a plain torch script), torch's
    excepthook prefixes each traceback line with "[rankN]: ", and torchrun's tee prefixes every
    line it copies to this console with the same."""

    DOUBLED = re.compile(r"^(\[rank\d+\]: )\1+", re.MULTILINE)

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(self.DOUBLED.sub(r"\1", text))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _single_rank_prefix() -> Iterator[None]:
    """sys.stdout and sys.stderr, where torchrun's tee writes the workers' lines, as _SinglePrefix."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _SinglePrefix(sys.stdout), _SinglePrefix(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


class _QuietWorkerFailures(logging.Filter):
    """Drops torchelastic's own lines about failed workers: cpctl reports the root cause itself."""

    LINES = {  # logger: what its dropped lines contain
        "torch.distributed.elastic.multiprocessing.api": ("failed (exitcode", "closing signal"),
        # on a node whose peer, the one hosting the rendezvous store, went away first
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous": ("has failed to shutdown the rendezvous",),
    }

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


@contextlib.contextmanager
def _quiet_worker_failures() -> Iterator[None]:
    filters = {logging.getLogger(name): _QuietWorkerFailures(lines) for name, lines in _QuietWorkerFailures.LINES.items()}
    for logger, quiet in filters.items():
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger, quiet in filters.items():
            logger.removeFilter(quiet)


# ----------------------------------------------------------------------------- waiting for nodes


_NO_RENDEZVOUS_STATE = b"Y2FuaW1hZGFt"  # C10dRendezvousBackend's value before any node joined


class _RendezvousWatch:
    """Lines on stderr while this node waits at the rendezvous for the other nodes: one when it
    starts, then after FIRST_REPORT_S and every REPORT_EVERY_S seconds until all joined.

    The nodes that joined are read from the c10d rendezvous state in the endpoint's store (a
    client of its own, from a background thread); when that state cannot be read the lines
    say what is expected, without a count.
    """

    FIRST_REPORT_S = 5.0
    REPORT_EVERY_S = 30.0
    POLL_S = 1.0

    def __init__(self, args: object, *, nnodes: int) -> None:
        self.endpoint = str(args.rdzv_endpoint)  # type: ignore[attr-defined]
        self.nnodes = nnodes
        self.key = f"torch.rendezvous.{args.rdzv_id}"  # type: ignore[attr-defined]  # C10dRendezvousBackend's
        self.timeout_s = _join_timeout(str(args.rdzv_conf or ""))  # type: ignore[attr-defined]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpctl-rendezvous-watch", daemon=True)
        self._store: object | None = None
        self.joined: int | None = None  # nodes in the rendezvous when last read
        self.complete = False  # whether all had joined then

    def __enter__(self) -> _RendezvousWatch:
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
            hint = "" if reported else "; run the same `cpctl launch` (same --nnodes, --rdzv-endpoint) on every node"
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
            if not store.check([self.key]):  # type: ignore[attr-defined]
                return 0, False
            value = store.get(self.key)  # type: ignore[attr-defined]
            if value == _NO_RENDEZVOUS_STATE:
                return 0, False
            state = pickle.loads(base64.b64decode(value))  # what C10dRendezvousBackend.get_state decodes
            return len(state.participants), bool(state.complete)
        except Exception:  # not reachable yet, or a state this version does not know how to read
            return None, False


def _join_timeout(rdzv_conf: str) -> int:
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


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _check_script(script: str, *, cwd: Path) -> None:
    path = cwd / script
    if path.is_file():
        return
    if path.is_dir():
        raise CpctlError(f"{script}: is a directory, not a script; pass a Python file, or -m MODULE for a package")
    near = difflib.get_close_matches(path.name, [p.name for p in path.parent.glob("*.py")], n=1) if path.parent.is_dir() else []
    hint = f"; did you mean {Path(script).parent / near[0]}?" if near else "; pass the path to a Python file (or -m MODULE)"
    raise CpctlError(f"{script}: no such script{hint}")


def _check_module(name: str, *, cwd: Path) -> None:
    """Find MODULE as `python -m` in cwd would, without importing (so running no package code)."""
    search: list[str] | None = [str(cwd), *sys.path[1:]]
    parts = name.split(".")
    for depth, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, search) if search is not None else None
        if spec is None and depth == 0:
            with contextlib.suppress(ImportError, ValueError):
                spec = importlib.util.find_spec(part)  # a built-in or otherwise-installed top-level module
        if spec is None:
            prefix = ".".join(parts[: depth + 1])
            raise CpctlError(f"-m {name}: no module named {prefix!r} (searched {cwd} and sys.path); check the name")
        search = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
        if search is None and depth < len(parts) - 1:
            raise CpctlError(f"-m {name}: {'.'.join(parts[: depth + 1])!r} is a module, not a package")
