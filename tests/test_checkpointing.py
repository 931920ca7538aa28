"""Activation checkpointing under CP when a backward runs twice (retain_graph): every recompute
attends across the CP group again, at both levels, and the gradients are the plain model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, tiered


@pytest.mark.parametrize("level", tiered(["full", "selective"], quick={"selective"}))
def test_a_second_backward_recomputes_exactly(tmp_path: Path, pools, level: str) -> None:
    out = tmp_path / "grads.json"
    pools[2].run(REPO / "tests" / "workers" / "recompute_cases.py", str(out), cwd=tmp_path,
                 flags=("--cp-size", "2", "--activation-checkpointing", "true", "--checkpoint-level", level))
    result = json.loads(out.read_text())
    assert (result["cp"], result["level"]) == (2, level)
    assert result["grads"] <= 1e-5
