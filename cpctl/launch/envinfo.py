"""What cpctl needs from this machine: the torch version, devices, backends; `check` and `env`.

Versions are read through importlib.metadata, so `cpctl launch --dry-run` and
`cpctl check --static` never import torch; only the device and backend probes do.
This module returns data; the CLI decides how to show it.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cpctl.errors import CpctlError
from cpctl.config.rules import gpus
from cpctl.config import (
    LOCAL_PROFILE,
    PROFILE_ENV_VAR,
    USER_PROFILE_NAME,
    Resolved,
    detect_machine,
    merge_layers,
    resolve,
    target_machine,
    user_config_dir,
)
from cpctl import versions

REPORTED_PACKAGES = ("cpctl", "torch", "numpy", "typer", "rich", "pyyaml", "questionary")
# The libraries whose models and scripts cpctl runs (every bug report needs their versions), with
# the releases cpctl's version gates accept where it has them.
ECOSYSTEM = (("transformers", versions.KNOWN_TRANSFORMERS), ("accelerate", versions.KNOWN_ACCELERATE),
             ("trl", versions.KNOWN_TRL), ("peft", None), ("datasets", None), ("safetensors", None))


# ----------------------------------------------------------------------------- check


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str


def run_checks(
    *,
    flags: Mapping[str, str] | None = None,
    config: str | Path | None = None,
    profile_name: str | None = None,
    static: bool = False,
    environ: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[Resolved | None, list[Check]]:
    """Validate a profile and this environment without launching. Imports torch only for the
    device and backend checks, which `static` skips."""
    environ = os.environ if environ is None else environ
    checks: list[Check] = []
    resolved: Resolved | None = None
    try:
        machine = detect_machine(environ)
        if static:
            values, _, _ = merge_layers(flags=flags, config=config, profile_name=profile_name, environ=environ, cwd=cwd)
            machine, described = target_machine(values, detected=machine)
            checks.append(Check("target", None, f"--static: validated as on {described}"))
        resolved = resolve(flags=flags, config=config, profile_name=profile_name, environ=environ, cwd=cwd, machine=machine)
        checks.append(Check("profile", True, describe(resolved)))
    except CpctlError as exc:
        checks.append(Check("profile", False, str(exc)))

    torch_version = versions.installed_version("torch")
    problem = versions.torch_problem(torch_version)
    checks.append(Check(f"torch >= {'.'.join(map(str, versions.MIN_TORCH))}", problem is None, problem or torch_version or ""))

    checks.extend(_framework_checks(resolved))
    if static:
        checks.append(Check("devices", None, "skipped (--static)"))
        checks.append(Check("backend", None, "skipped (--static)"))
    elif resolved is None or problem is not None:
        why = "invalid profile" if resolved is None else "no usable torch"
        checks.append(Check("devices", None, f"skipped ({why})"))
        checks.append(Check("backend", None, f"skipped ({why})"))
    else:
        checks.extend(_device_checks(resolved))
    return resolved, checks


def _framework_checks(resolved: Resolved | None) -> list[Check]:
    """accelerate, transformers and TRL against the releases cpctl knows. An accelerate script needs
    a known accelerate (its workers refuse another); a transformers or TRL cpctl has not run is said
    (under CP their trainers refuse it in the worker)."""

    for_accelerate = resolved is not None and resolved.profile.launch.script_api == "accelerate"
    checks = []
    for name, known, required in (("accelerate", versions.KNOWN_ACCELERATE, for_accelerate),
                                  ("transformers", versions.KNOWN_TRANSFORMERS, False),
                                  ("trl", versions.KNOWN_TRL, False)):
        version = versions.installed_version(name)
        releases = ", ".join(f"{k}.x" for k in known)
        if version is None:
            if required:
                checks.append(Check(name, False, f"not installed; launch.script_api: accelerate needs it ({releases})"))
            continue
        if versions.is_known(version, known):
            checks.append(Check(name, True, f"{version}, a release cpctl knows"))
        elif required:
            checks.append(Check(name, False, f"{version} is not a release cpctl knows ({releases}); install one of those"))
        else:
            checks.append(Check(name, True, f"{version}; cpctl has run {releases} (others may differ)"))
    return checks


def describe(resolved: Resolved) -> str:
    """`cp 2 x dp_shard 1 = world 2 (1 node x 2 cpu processes)`."""
    profile = resolved.profile
    par, launch = profile.parallelism, profile.launch
    axes = [("dp_replicate", par.dp_replicate_size), ("dp_shard", par.dp_shard_size), ("cp", par.cp_size), ("sp", par.sp_size),
            ("tp", par.tp_size)]
    shown = [f"{name} {size}" for name, size in axes if size != 1] or ["dp_shard 1"]
    nodes = f"{launch.nnodes} node{'s' if launch.nnodes > 1 else ''}"
    return f"{' x '.join(shown)} = world {profile.world_size} ({nodes} x {launch.nproc_per_node} {launch.device} processes)"


def _device_checks(resolved: Resolved) -> list[Check]:
    import torch
    import torch.distributed as dist

    launch = resolved.profile.launch
    if launch.device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = Check(
            "devices",
            count >= launch.nproc_per_node,
            f"{gpus(count)} usable by torch, {launch.nproc_per_node} needed per node",
        )
        backend_name, available = "nccl", dist.is_available() and dist.is_nccl_available()
    else:
        cores = os.cpu_count() or 1
        devices = Check("devices", True, f"cpu: {launch.nproc_per_node} processes on {cores} cores")
        backend_name, available = "gloo", dist.is_available() and dist.is_gloo_available()
    backend = Check("backend", available, f"{backend_name} {'available' if available else 'not available in this torch build'}")
    return [devices, backend]


# ----------------------------------------------------------------------------- env


def active_default_profile(*, cwd: str | Path | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Which file `cpctl launch` picks up with no --config/--profile: ./cpctl.yaml over the user default."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    local = cwd / LOCAL_PROFILE
    user = user_config_dir(environ) / USER_PROFILE_NAME
    found = [str(path) for path in (local, user) if path.is_file()]
    if not found:
        return "built-in defaults"
    return " over ".join(found)


def package_versions() -> list[tuple[str, str]]:
    rows = [("python", f"{platform.python_version()} ({platform.python_implementation()}, {platform.machine()})")]
    rows += [(name, versions.installed_version(name) or "not installed") for name in REPORTED_PACKAGES]
    for name, known in ECOSYSTEM:
        version = versions.installed_version(name)
        if version is None:
            rows.append((name, "not installed"))
        elif known is None or versions.is_known(version, known):
            rows.append((name, version))
        else:
            rows.append((name, f"{version} (cpctl knows {', '.join(known)}: its CP route refuses this release)"))
    return rows


def devices_and_backends() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Devices and distributed backends as torch sees them (imports torch)."""
    if versions.installed_version("torch") is None:
        return [("torch", "not installed")], []
    import torch
    import torch.distributed as dist

    devices = [("cpu", f"{os.cpu_count()} cores")]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        devices.append(("cuda", f"{count} x {', '.join(names)} (CUDA {torch.version.cuda})"))
    else:
        devices.append(("cuda", f"not available (torch built with CUDA {torch.version.cuda})" if torch.version.cuda else "not available (CPU-only torch build)"))
    backends = []
    for name in ("gloo", "nccl", "mpi"):
        probe = getattr(dist, f"is_{name}_available", None)
        available = bool(dist.is_available() and probe is not None and probe())
        backends.append((name, "available" if available else "not available"))
    return devices, backends


def profile_context(*, cwd: str | Path | None = None, environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The default profile, the CPCTL_* and SLURM variables that apply, and what they resolve to."""
    environ = os.environ if environ is None else environ
    rows = [("default profile", active_default_profile(cwd=cwd, environ=environ))]
    overrides = sorted(name for name in environ if name.startswith("CPCTL_") and name != PROFILE_ENV_VAR)
    rows.append(("CPCTL_* variables", ", ".join(f"{name}={environ[name]}" for name in overrides) or "none"))
    if "SLURM_JOB_ID" in environ:
        rows.append(("SLURM", f"job {environ['SLURM_JOB_ID']}, {environ.get('SLURM_JOB_NUM_NODES', environ.get('SLURM_NNODES', '?'))} nodes"))
    try:
        rows.append(("resolves to", describe(resolve(environ=environ, cwd=cwd))))
    except CpctlError as exc:
        rows.append(("resolves to", f"error: {exc}"))
    return rows
