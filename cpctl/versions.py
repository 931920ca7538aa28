"""The releases cpctl needs and the ones it knows: one place for every version gate.

Torch-free: versions are read through importlib.metadata, so the CLI answers without importing
torch, and both the launcher and the workers check against the same facts.
"""

from __future__ import annotations

import importlib.metadata
import re

from cpctl.errors import CpctlError

MIN_TORCH = (2, 6)  # FSDP2 (fully_shard) and DTensor-based CP attention need it
KNOWN_ACCELERATE = ("1.15",)  # major.minor releases whose variable names were checked
KNOWN_TRANSFORMERS = ("5.17", "5.24")  # releases whose Trainer CP route was run under cpctl
KNOWN_TRL = ("1.16",)  # releases whose SFTTrainer route (packing, evaluation) was run under cpctl


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_version(text: str) -> tuple[int, int]:
    """`2.13.0+cpu` -> (2, 13); `2.6.0.dev20241001` -> (2, 6)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise CpctlError(f"cannot read the version {text!r}")
    return int(match.group(1)), int(match.group(2))


def torch_problem(version: str | None) -> str | None:
    """Why this torch cannot run cpctl, or None when it can."""
    wanted = ".".join(map(str, MIN_TORCH))
    if version is None:
        return f"torch is not installed; install torch>={wanted} (e.g. pip install torch)"
    if parse_version(version) < MIN_TORCH:
        return f"torch {version} is too old; cpctl needs torch>={wanted} for FSDP2 and context parallelism (pip install -U torch)"
    return None


def require_torch(version: str | None = None) -> str:
    """The installed torch version, or a CpctlError when it is missing or too old."""
    version = installed_version("torch") if version is None else version
    problem = torch_problem(version)
    if problem is not None or version is None:
        raise CpctlError(problem or "torch is not installed")
    return version


def is_known(version: str, known: tuple[str, ...]) -> bool:
    """Whether `version` ("1.15.0", "5.24.0.dev0") is one of the `known` major.minor releases."""
    return ".".join(version.split(".")[:2]) in known
