"""Shared fixtures (`isolated` gives a test its own cwd and a clean cpctl environment) and the
test tiers: `pytest` runs the quick tier (every pure and in-process test, and one real launch
per capability); `pytest --full` adds the tests marked `full` (the rest of the launch matrices),
as CI does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launching import AMBIENT_PREFIXES


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="the full tier (what CI runs): every multi-process launch of the matrices, not one per capability")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    quick = [item for item in items if item.get_closest_marker("full") is None]
    if len(quick) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full") is not None])
        items[:] = quick


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
