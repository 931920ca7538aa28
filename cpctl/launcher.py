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
import importlib.machinery
import importlib.util
import json
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpctl import envinfo
from cpctl.errors import CpctlError
from cpctl.config import PROFILE_ENV_VAR, Profile, Resolved

# torchrun reads the per-line prefix template of tee'd worker output from this variable.
LOG_PREFIX_ENV_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LOG_PREFIX = "[rank${rank}]: "
TEE_ALL = "3"  # stdout and stderr of every local rank, to console (prefixed) and to log files


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
    if module:
        argv.append("--module")
    return [*argv, target, *target_args]


def worker_env(profile: Profile, *, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the launcher sets for its workers."""
    env = {PROFILE_ENV_VAR: json.dumps(profile.to_dict(), separators=(",", ":"))}
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
    envinfo.require_torch()
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
    """
    try:
        with _environ(plan.env):
            _run_torchrun(list(plan.torchrun_args))
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent installed its own handlers
        raise LaunchError("interrupted; workers stopped", exit_code=128 + signal.SIGINT) from None


def _run_torchrun(argv: list[str]) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        torchrun.run(torchrun.get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        raise _worker_failure(exc) from None
    except SignalException as exc:
        # the agent has already stopped the workers when this reaches us
        raise LaunchError(f"interrupted by {exc.sigval.name}; workers stopped", exit_code=128 + int(exc.sigval)) from None
    except RendezvousError as exc:
        raise LaunchError(
            f"rendezvous failed: {_first_line(str(exc)) or type(exc).__name__}; check that every node runs "
            "`cpctl launch` with the same --nnodes and --rdzv-endpoint and can reach that host:port",
            exit_code=1,
        ) from None


def _worker_failure(exc: object) -> LaunchError:
    """One line on the root-cause rank of a torchrun ChildFailedError, exiting with its code."""
    rank, failure = exc.get_first_failure()  # type: ignore[attr-defined]
    code = failure.exitcode
    if code < 0:
        how = f"was killed by {failure.signal_name()}"
        exit_code = 128 - code
    else:
        how = f"exited with code {code}"
        exit_code = code or 1
    message = f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
    recorded = failure.error_file_data.get("message") != "<NONE>"  # the worker used @record
    if recorded and _first_line(failure.message):
        message += f": {_first_line(failure.message)}"
    others = len(exc.failures) - 1  # type: ignore[attr-defined]
    if others:
        message += f" (and {others} more rank{'s' if others > 1 else ''} after it)"
    return LaunchError(message + "; its output is above", exit_code=exit_code)


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
