"""Helpers for tests that start real `cpctl launch` processes: a clean environment, the CLI in
a subprocess, and waiting for it with a time limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120


def launch_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment minus anything that would change the profile or torchrun."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPCTL_", "SLURM_", "PET_", "TORCHELASTIC_"))}
    env |= {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    return env


def cpctl(*args: str, tmp_path: Path, cwd: Path | None = None, **popen: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cpctl.cli", "launch", *args], cwd=cwd or tmp_path, env=launch_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"cpctl launch did not finish in {TIMEOUT}s:\n{out}\n{err}")
    return proc.returncode, out, err
