"""Profile -> torchrun argv -> `torch.distributed.run`, PyTorch's own elastic agent.

cpctl does what accelerate does: it builds the argv that `torchrun` would be given and hands
it to `torch.distributed.run.run(get_args_parser().parse_args(argv))`. Standalone rendezvous,
c10d rendezvous across nodes, signal forwarding and root-cause reports all come from
torchrun itself. Building a `LaunchConfig` by hand is avoided on purpose: its defaults
(rdzv_backend etcd, max_restarts 3) are not torchrun's, and `--standalone` lives in `run()`.
Two rendezvous are swapped at launch for cpctl's variants of the same, registered with torch's
registry: a single node's stores on loopback (launch/loopback.py), and across nodes, c10d with
each machine's ranks placed by its node rank (launch/rendezvous.py); the dry run prints the
torchrun line they stand for.

The resolved profile reaches the workers as JSON in `CPCTL_RESOLVED_PROFILE` (workers inherit
the launcher's environment); torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... as usual.

What the user sees while it runs has modules of its own: a failed worker told as one error, and
each restart as one line (launch/failures.py), this node's wait for the others
(launch/rendezvous.py), each worker's lines prefixed with its rank once (launch/worker_output.py).

Only `launch()` imports torch; `prepare()` (and so `cpctl launch --dry-run`) does not.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.machinery
import importlib.util
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpctl.config import PROFILE_ENV_VAR, Profile, Resolved
from cpctl.config.layers import MachineSource
from cpctl.errors import CpctlError, LaunchError
from cpctl.failure_report import CHECKPOINT_NOTE, ERROR_DIR_ENV_VAR, TRACEBACK_GLOB
from cpctl import versions
from cpctl.launch import failures, loopback, rendezvous
from cpctl.launch.failures import MemoryWatch
from cpctl.launch.accelerate_env import accelerate_env
from cpctl.launch.rendezvous import RendezvousWatch
from cpctl.launch.worker_output import LOG_PREFIX, LOG_PREFIX_ENV_VAR, TEE_ALL, single_rank_prefix

ACCELERATE_SHIM = "cpctl.integrations.accelerate_shim"  # each worker's entry point for an accelerate script


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one `cpctl launch` will do, computed before anything is spawned."""

    resolved: Resolved
    target: str  # a script path, or a module name when `module`
    target_args: tuple[str, ...]
    module: bool
    torchrun_args: tuple[str, ...]  # what torchrun's own parser is given
    env: dict[str, str]  # set in the launcher's environment; workers inherit it
    # this machine's node rank when it was given one (see torchrun_args), which then places its
    # ranks (launch/rendezvous.py); None: the default, or a profile's that every machine shares
    node_rank: int | None = None

    def command_line(self) -> str:
        """The equivalent shell command: env assignments, then `torchrun ...`."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join([*assignments, "torchrun", shlex.join(self.torchrun_args)])


def torchrun_args(profile: Profile, *, target: str, target_args: Sequence[str], module: bool,
                  node_rank_of_this_machine: bool = True) -> list[str]:
    """The torchrun argv for a resolved profile (every value explicit: no torchrun default is relied on).
    `node_rank_of_this_machine`: this machine was given its node rank (a flag, a CPCTL_ variable,
    SLURM, an accelerate config file's machine_rank), not the default nor a profile every machine shares."""
    launch = profile.launch
    argv = [
        f"--nnodes={launch.nnodes}",
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
    ]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        argv.append("--standalone")  # a private c10d store on a free local port
    else:
        # torchrun honours --node-rank only for its static backend; c10d numbers the machines itself
        # (sorted by host name). A given node_rank decides which machine hosts the rendezvous store,
        # c10d's is_host: node_rank 0, so no other one guesses from its host name; and, at launch,
        # each machine's ranks (cpctl's c10d rendezvous, launch/rendezvous.py). A node rank not given
        # to this machine says nothing (a profile's is the same on every machine): c10d's own rule
        # (the endpoint's host) then.
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}"]
        if node_rank_of_this_machine:
            argv.append(f"--rdzv-conf=is_host={'true' if launch.node_rank == 0 else 'false'}")
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
    if "PYTHONFAULTHANDLER" not in environ:
        # a worker that crashes in native code (SIGSEGV, SIGABRT, ...) prints its Python stack
        # above the launcher's line instead of leaving only the signal's name
        env["PYTHONFAULTHANDLER"] = "1"
    return env


def prepare(
    resolved: Resolved,
    *,
    target: str,
    target_args: Sequence[str] = (),
    module: bool = False,
    cwd: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Check what the profile cannot (the script or module, the torch install) and plan the launch."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    environ = os.environ if environ is None else environ
    if module:
        _check_module(target, cwd=cwd)
    else:
        _check_script(target, cwd=cwd)
    versions.require_torch()
    profile = resolved.profile
    given = isinstance(resolved.sources.get("launch.node_rank"), MachineSource)
    return LaunchPlan(
        resolved=resolved,
        target=target,
        target_args=tuple(target_args),
        module=module,
        torchrun_args=tuple(torchrun_args(profile, target=target, target_args=target_args, module=module,
                                          node_rank_of_this_machine=given)),
        env=worker_env(profile, environ=environ),
        node_rank=profile.launch.node_rank if given else None,
    )


def launch(plan: LaunchPlan) -> None:
    """Run the workers through torchrun's elastic agent; return when all succeeded.

    Raises LaunchError with the exit code to use: the root-cause rank's own code when a worker
    fails (torchrun itself would exit 1), 128 + signal when interrupted (130 for Ctrl-C).
    The caller checks the GPUs torch sees first (require_devices), before anything it prints.
    """
    profile = plan.resolved.profile
    # One directory per launch: each worker writes its traceback here when it fails (see
    # cpctl.failure_report), and torchrun its logs (else it leaves a torchelastic_* directory in /tmp
    # every time). Removed after a launch that went well; kept, and named, after a failure.
    error_dir = Path(tempfile.mkdtemp(prefix="cpctl-"))
    logs = error_dir / "torchrun"
    argv = [f"--log-dir={logs}", *plan.torchrun_args]
    try:
        with _environ({**plan.env, ERROR_DIR_ENV_VAR: str(error_dir)}), MemoryWatch() as memory:
            killed_by = functools.partial(memory.killed_by, memory=profile.memory)
            # each restart told on one line: why, and the checkpoint the workers resume from
            restarts = failures.Restarts(max_restarts=profile.launch.max_restarts, logs=logs, error_dir=error_dir,
                                         nnodes=profile.launch.nnodes, ranks=memory.ranks, killed_by=killed_by)
            with restarts if profile.launch.max_restarts else contextlib.nullcontext():
                _run_torchrun(argv, nnodes=profile.launch.nnodes, node_rank=plan.node_rank, killed_by=killed_by)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent installed its own handlers
        raise LaunchError("interrupted; workers stopped", exit_code=128 + signal.SIGINT) from None
    finally:
        # Whatever ended the launch, only the workers' traceback files stay (the error names
        # them); torchrun's logs repeat what the console showed.
        shutil.rmtree(logs, ignore_errors=True)
        for note in error_dir.glob(f"{CHECKPOINT_NOTE}*"):  # the Checkpointer's note (failure_report.py)
            note.unlink(missing_ok=True)
        if not any(error_dir.glob(TRACEBACK_GLOB)):
            shutil.rmtree(error_dir, ignore_errors=True)


def require_devices(profile: Profile) -> None:
    """A cuda profile's GPUs, as torch sees them (check_cuda_devices): the last check before `launch`
    starts workers. Raises CpctlError."""
    if profile.launch.device == "cuda":
        import torch

        check_cuda_devices(profile.launch.nproc_per_node, device_count=torch.cuda.device_count(), environ=os.environ)


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


def _run_torchrun(argv: list[str], *, nnodes: int = 1, node_rank: int | None = None,
                  killed_by: Callable[..., str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    argv = rendezvous.rendezvous_argv(loopback.rendezvous_argv(argv), node_rank=node_rank)
    args = torchrun.get_args_parser().parse_args(argv)
    watch = None
    if nnodes > 1:
        watch = RendezvousWatch(endpoint=args.rdzv_endpoint, run_id=args.rdzv_id, rdzv_conf=args.rdzv_conf or "",
                                nnodes=nnodes)
    try:
        with failures.quiet_worker_failures(), single_rank_prefix(), watch or contextlib.nullcontext():
            torchrun.run(args)
    except ChildFailedError as exc:
        raise failures.worker_failure(exc.failures, killed_by=killed_by) from None
    except SignalException as exc:
        # the agent has already stopped the workers when this reaches us
        raise LaunchError(f"interrupted by {exc.sigval.name}; workers stopped", exit_code=128 + int(exc.sigval)) from None
    except KeyboardInterrupt:
        waiting = None if watch is None else watch.interrupted()
        if waiting is not None:
            raise waiting from None
        raise
    except RendezvousError as exc:
        raise rendezvous.failed(exc, watch=watch) from None


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
