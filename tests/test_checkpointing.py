"""Activation checkpointing under CP when a backward runs twice (retain_graph): every recompute
attends across the CP group again, at both levels, and the gradients are the plain model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, cpctl, finish


@pytest.mark.parametrize("level", ["full", "selective"])
def test_a_second_backward_recomputes_exactly(tmp_path: Path, level: str) -> None:
    out = tmp_path / "grads.json"
    code, stdout, stderr = finish(cpctl("--device", "cpu", "--nproc-per-node", "2", "--cp-size", "2",
                                        "--activation-checkpointing", "true", "--checkpoint-level", level,
                                        str(REPO / "tests" / "workers" / "recompute_cases.py"), str(out),
                                        tmp_path=tmp_path))
    assert code == 0, stdout + stderr
    result = json.loads(out.read_text())
    assert (result["cp"], result["level"]) == (2, level)
    assert result["grads"] <= 1e-5
