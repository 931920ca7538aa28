"""Ulysses (sp) and 2D (sp x cp ring) attention against single-process SDPA on the full sequence.

tests/workers/ulysses_cases.py runs every case with gloo on CPU in the session's pool of 4
processes (tests/pool.py), once, for each (cp, sp) layout: sp 4; sp 2 x cp 2 with both ring
strategies; sp 2 twice side by side. The quick tier runs a quarter of the cases (every head
layout, mask, dtype and strategy: `cases(quick=True)`), the full tier all. fp32 bar: 1e-5, as the
CP engine's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import REPO
from pool import Pool

sys.path.insert(0, str(REPO / "tests" / "workers"))
from ulysses_cases import LAYOUTS, cases

WORKER = REPO / "tests" / "workers" / "ulysses_cases.py"
WORLD = 4
TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2  # relative to the largest value: a few bf16 roundings (2**-8 each)
TIMEOUT = 600
OPTIONS = ("window", "chunk", "v_dim", "dtype", "documents")


def case_id(cp: int, sp: int, case: dict) -> str:
    options = [f"{name}{case[name]}" for name in OPTIONS if case.get(name) not in (None, "float32")]
    return "-".join([
        f"cp{cp}xsp{sp}", case["strategy"], "causal" if case["causal"] else "full",
        "balanced" if case["load_balance"] else "plain", f"heads{case['q_heads']}:{case['kv_heads']}",
        f"batch{case['batch']}", *options,
    ])


ALL = [(cp, sp, case) for cp, sp in LAYOUTS for case in cases(cp)]
QUICK = [(cp, sp, case) for cp, sp in LAYOUTS for case in cases(cp, quick=True)]


def tiered_cases(selected: list[tuple]) -> list:
    """`selected` as parameters: the quick tier's cases in both tiers, the others in the full one."""
    quick = {case_id(*c) for c in QUICK}
    return [pytest.param(*c, id=case_id(*c), marks=() if case_id(*c) in quick else pytest.mark.full) for c in selected]


def run_worker(tmp: Path, pool: Pool, *, quick: bool) -> dict[str, dict]:
    out = tmp / "cases.jsonl"
    pool.run(WORKER, str(out), *(["--quick"] if quick else []), cwd=tmp, timeout=TIMEOUT)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    records = {}
    for record in lines:
        case = {k: record[k] for k in ("strategy", "causal", "load_balance", "q_heads", "kv_heads", "batch")}
        case |= {k: record[k] for k in OPTIONS if k in record}
        records[case_id(record["cp"], record["sp"], case)] = record
    return records | {"__count__": len(lines)}


@pytest.fixture(scope="module")
def quick_tier(request: pytest.FixtureRequest) -> bool:
    return not request.config.getoption("--full")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory, pools, quick_tier: bool):
    return run_worker(tmp_path_factory.mktemp("ulysses"), pools[4], quick=quick_tier)


def test_the_worker_ran_every_case(records, quick_tier: bool) -> None:
    selected = QUICK if quick_tier else ALL
    assert records["__count__"] == len(selected)
    assert sorted(k for k in records if k != "__count__") == sorted(case_id(*c) for c in selected)
    for cp, sp, case in selected:
        record = records[case_id(cp, sp, case)]
        assert (record["world"], record["seq"]) == (WORLD, 32 * cp * sp)


@pytest.mark.parametrize(("cp", "sp", "case"), tiered_cases(ALL))
def test_matches_single_process_sdpa(records, cp: int, sp: int, case: dict) -> None:
    errors = records[case_id(cp, sp, case)]["errors"]
    assert sorted(errors) == ["dk", "dq", "dv", "out"]
    # under autocast attention computes in bf16: its rounding against the fp32 reference, relative
    tolerance = BF16_TOLERANCE if case.get("dtype") == "autocast" else TOLERANCE
    assert all(error <= tolerance for error in errors.values()), errors


PLAIN = [(cp, sp, case) for cp, sp, case in ALL
         if set(case) == {"strategy", "causal", "load_balance", "q_heads", "kv_heads", "batch"}]


@pytest.mark.parametrize(("cp", "sp", "case"), tiered_cases(PLAIN))
def test_what_attention_keeps_for_backward_is_what_cpctl_plan_counts(records, cp: int, sp: int, case: dict) -> None:
    """The planner's per-token attention tensors (less the norm's) times this rank's tokens: the
    bytes autograd keeps in one Ulysses call, K/V repeated for fewer heads than sp included."""
    from cpctl.planner import ModelShape, Setup, Sizes
    from cpctl.planner.terms import _norm_saved, attention_saved_per_token

    record = records[case_id(cp, sp, case)]
    head_dim = 16
    model = ModelShape("test", vocab_size=8, dim=case["q_heads"] * head_dim, n_layers=1, n_heads=case["q_heads"],
                       n_kv_heads=case["kv_heads"], ffn_dim=8, head_dim=head_dim)
    sizes = Sizes(model, Setup(gpus=cp * sp, cp=cp, sp=sp, precision="no", batch=case["batch"]), record["seq"])
    per_token = attention_saved_per_token(sizes) - _norm_saved(sizes)
    assert record["saved_bytes"] == per_token * sizes.local_tokens


# ----------------------------------------------------------------------------- the planner's Ulysses buffers

MEMORY_WORKER = REPO / "tests" / "workers" / "ulysses_memory.py"
sys.path.insert(0, str(MEMORY_WORKER.parent))
from ulysses_memory import HEAD_DIM, HEADS, SP_SIZES

MEMORY_CASES = [(sp, q_heads, kv_heads, batch) for sp in SP_SIZES for q_heads, kv_heads in HEADS for batch in (1, 2)]


def run_memory_worker(tmp: Path, pool: Pool) -> dict[tuple, dict]:
    out = tmp / "memory.jsonl"
    pool.run(MEMORY_WORKER, str(out), cwd=tmp, timeout=TIMEOUT)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {(r["sp"], r["q_heads"], r["kv_heads"], r["batch"]): r for r in records}


@pytest.fixture(scope="module")
def memory_records(tmp_path_factory: pytest.TempPathFactory, pools):
    return run_memory_worker(tmp_path_factory.mktemp("ulysses-memory"), pools[4])


@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: "sp{}-heads{}:{}-batch{}".format(*c))
def test_ulysses_backward_buffers_are_within_what_cpctl_plan_counts(memory_records, case) -> None:
    """The bytes Ulysses' backward makes and holds at its peak (its all-to-all of the gradients back to
    the token layout) are the planner's Ulysses exchange term, less at most dout's all-to-all buffers
    (its send buffer and its head layout, 2 q), which the communication library frees when it is done
    with them: on gloo at times only after the gradients' all-to-all."""
    from cpctl.planner import ModelShape, Setup, Sizes
    from cpctl.planner.terms import ulysses_exchange_per_token

    sp, q_heads, kv_heads, batch = case
    record = memory_records[case]
    model = ModelShape("test", vocab_size=8, dim=q_heads * HEAD_DIM, n_layers=1, n_heads=q_heads, n_kv_heads=kv_heads,
                       ffn_dim=8, head_dim=HEAD_DIM)
    sizes = Sizes(model, Setup(gpus=sp, sp=sp, precision="no", batch=batch), record["seq"])
    planned = ulysses_exchange_per_token(sizes) * sizes.local_tokens
    dout_buffers = 2 * sizes.act * model.q_dim * sizes.local_tokens
    assert planned - dout_buffers <= record["backward_peak_bytes"] <= planned
