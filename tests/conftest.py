"""Shared fixtures and the test tiers.

`isolated` gives a test its own cwd and a clean cpctl environment. `pools` is the session's
long-lived gloo worker processes (tests/pool.py), one pool per process count: tests whose subject
runs inside the workers (engine numerics, runtime and Hugging Face equality checks) run their
worker scripts there, with the profile `cpctl launch` would give, instead of paying an
`import torch` (and transformers) per process per launch; what the launcher itself does is tested
with real `cpctl launch` runs.

Tiers: `pytest` runs the quick tier (every pure and in-process test, and per capability at least
one real multi-process run); `pytest --full` adds the tests marked `full` at the test
(`@pytest.mark.full`, or `launching.tiered` for the rest of a launch matrix).
Measured 2026-12-03 on 2 idle cores: the quick tier 269-342 s over seven runs (481 s before the
pools, 381-390 s before its share of the numeric matrices, the references run alongside and cached
bytecode); the full tier 1126 s in the afternoon, and in the evening, when the same machine ran
~20% slower, 1399 s before and 1252 s after the processes' fast exit and the merged launches
(29 minutes before the pools). 2026-12-04, 3374 full-tier tests: the quick tier 248 s, the full
tier 865-985 s (the machine's speed varies through the day)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launching import AMBIENT_PREFIXES, stop_started

# The session and every process it starts cache compiled bytecode (__pycache__, git-ignored) even
# where the shell asks Python not to: without it each launch's processes compile cpctl again
# (~0.8 s of CPU each) and pytest rewrites every test module again (~4 s) on each run.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(autouse=True)
def no_reference_outlives_its_test():
    """A one-process reference (launching.start_python) whose test failed before waiting for it."""
    yield
    stop_started()


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cwd = an empty tmp dir; no CPCTL_*/SLURM_* variables, no user default profile, no GPUs
    visible (so `device: auto` means cpu on every machine), wide rich output. Returns the cwd."""
    for name in list(os.environ):
        if name.startswith(AMBIENT_PREFIXES):
            monkeypatch.delenv(name)
    config_home = tmp_path / "xdg-config"
    config_home.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps table cells at the terminal width
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture(scope="session")
def tiny_hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny local hub (model, tokenizer, texts) for unmodified ecosystem scripts: tests/workers/tiny_hub.py."""
    import subprocess

    from launching import REPO, TIMEOUT, launch_env

    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hub")
    subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "tiny_hub.py"), str(out)], check=True,
                   env=launch_env(out), capture_output=True, timeout=TIMEOUT)
    return out


@pytest.fixture(scope="session")
def pools(tmp_path_factory: pytest.TempPathFactory):
    """The session's pools of gloo worker processes (tests/pool.py), one per process count, each
    started on its first job."""
    from pool import Pools

    pools = Pools(tmp_path_factory.mktemp("pools"))
    yield pools
    pools.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="the full tier: every multi-process launch of the matrices, not one per capability")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full") is not None]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item.get_closest_marker("full") is None]
