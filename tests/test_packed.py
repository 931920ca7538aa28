"""Packed documents under CP (tests/workers/packed_cases.py), one launch per (cp size, strategy).

Every case must equal the documents trained one by one, and, for the Hugging Face model, one
process on the same packed rows (transformers builds the document mask there), in fp32 within
1e-5 (and `rt.document_mean`, the mean of the documents' own means, against the same one by one): the example Llama and an unmodified Hugging Face Llama; one-token documents, documents
across chunk and rank boundaries, a document that is the whole row, many short ones, rows
packed differently; documents given to the context (cost-balanced chunks) or only through the
model's position ids (head-tail chunks). A case with attention blind to the documents must
differ: the comparison can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import REPO, launch_once, tiered

pytest.importorskip("transformers")

from cpctl.attention import Strategy  # noqa: E402  (after the skip: torch comes with transformers)

WORKER = REPO / "tests" / "workers" / "packed_cases.py"
TOLERANCE = 1e-5
RUNS = [(cp, strategy.value) for cp in (2, 4) for strategy in Strategy]


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory: pytest.TempPathFactory, pools):
    """(cp, strategy) -> the worker's results; each run once, on first use, in the session's pool of
    processes of its size (tests/pool.py)."""

    def run(tmp: Path, cp: int, strategy: str) -> dict:
        out = tmp / "packed.json"
        pools.run(WORKER, str(out), flags=("--nproc-per-node", str(cp), "--cp-size", str(cp),
                                           "--cp-comm-strategy", strategy), cwd=tmp)
        return json.loads(out.read_text())

    return launch_once(tmp_path_factory, "packed", run)


@pytest.mark.parametrize(("cp", "strategy"), tiered(RUNS, quick={(2, "allgather")}),
                         ids=[f"cp{cp}-{s}" for cp, s in RUNS])
def test_packed_training_equals_the_documents_one_by_one(packed_runs, cp: int, strategy: str) -> None:
    run = packed_runs(cp, strategy)
    assert (run["cp"], run["strategy"]) == (cp, strategy)
    cases = {name: case for name, case in run["cases"].items() if not name.endswith("/leak")}
    assert len(cases) == 17  # 15 token-mean cases, 2 document-mean ones
    for name, case in cases.items():
        assert case["loss_vs_alone"] <= TOLERANCE, (name, case)
        assert case["grads_vs_alone"] <= TOLERANCE, (name, case)
        if name.startswith("hf/"):
            assert case["grads_vs_packed"] <= TOLERANCE, (name, case)
        if name.endswith(("/documents", "/document_mean")):  # documents given to the context: placed by cost
            assert case["balance"] is not None and case["balance"] <= 1.25, (name, case)
        else:
            assert case["balance"] is None and case["local_chunks"] == 2, (name, case)


@pytest.mark.full
def test_packed_documents_at_cp_1_equal_the_documents_one_by_one(tmp_path: Path, pools) -> None:
    """One process (cp 1): nothing is sharded, attention goes through the same engine, and
    every case of cp 2 holds, plus a row of odd length that no cp > 1 could divide."""
    out = tmp_path / "packed.json"
    pools[1].run(WORKER, str(out), cwd=tmp_path)
    cases = {name: case for name, case in json.loads(out.read_text())["cases"].items() if not name.endswith("/leak")}
    assert len(cases) == 20  # the 17 of cp > 1, and the odd-length row for both models (and both ways for hf)
    assert {name for name in cases if "/odd_length/" in name} == {
        "example/odd_length/documents", "hf/odd_length/documents", "hf/odd_length/positions"}
    for name, case in cases.items():
        assert case["loss_vs_alone"] <= TOLERANCE and case["grads_vs_alone"] <= TOLERANCE, (name, case)
        if name.startswith("hf/"):
            assert case["grads_vs_packed"] <= TOLERANCE, (name, case)
        assert case["balance"] is None and case["local_chunks"] == 1, (name, case)  # one chunk: the whole row


@pytest.mark.parametrize(("cp", "strategy"), RUNS[:1], ids=["cp2-allgather"])
def test_attention_across_documents_is_caught(packed_runs, cp: int, strategy: str) -> None:
    leak = packed_runs(cp, strategy)["cases"]["example/mixed/leak"]
    assert leak["grads_vs_alone"] > 1e-4 and leak["loss_vs_alone"] > 1e-4


@pytest.mark.full
def test_the_packed_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """scripts/bench_packed.py --tiny on CPU: its attention check passes, both steps train, one JSON line each."""
    import subprocess
    import sys

    from launching import launch_env

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_packed.py"), "--tiny", "--warmup", "0",
                           "--steps", "1"], cwd=tmp_path, env=launch_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    dense, packed, ratio = (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    assert (dense["kind"], packed["kind"], ratio["kind"]) == ("dense", "packed", "ratio")
    assert (dense["documents"], packed["documents"], packed["document"]) == (1, 8, 128)
    assert dense["attention_check"] <= 1e-5  # the engine's packed attention against SDPA per document, fp32
    assert 0 < packed["loss"] < 10 and 0 < dense["loss"] < 10  # about ln(512) at random weights
    assert ratio["packed_over_dense"] > 0
