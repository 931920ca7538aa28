"""The CP attention engine against single-process SDPA on the full sequence.

tests/workers/engine_cases.py runs every case with gloo on CPU, once per world size (1, 2 and 4
processes, in the session's pools of processes, tests/pool.py; a few seconds each), and writes
the max abs error of the output and of dq/dk/dv per case; each case is then its own test here. One process is a
group of one: plain attention there is one kernel call (attention/whole.py), the rest the blocks. fp32 bar: 1e-5.
Besides plain causal and full attention: sliding windows and chunked attention that cut
through shards, packed documents (one-token ones, ones spanning ranks, many short ones, rows
packed differently; on the cost-balanced layout), padding (keys no query sees: left padding
that leaves whole chunks seeing nothing, right padding, holes), all against SDPA with the
explicit mask; value heads of another size (MLA), fp64.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from launching import REPO, launch_once, tiered
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cpctl.attention import Strategy

WORKER = REPO / "tests" / "workers" / "engine_cases.py"
STRATEGIES = tuple(strategy.value for strategy in Strategy)
WORLD_SIZES = tiered((1, 2, 4), quick={1, 2})  # 1: a group of one, where plain attention is one kernel call
TOLERANCE = 1e-5  # the engine's fp32 bar
TIMEOUT = 180

CASES = [
    {"strategy": strategy, "causal": causal, "load_balance": load_balance, "q_heads": q_heads, "kv_heads": kv_heads,
     "batch": batch}
    for strategy, causal, load_balance, (q_heads, kv_heads), batch in itertools.product(
        STRATEGIES, (True, False), (True, False), ((4, 4), (4, 2), (4, 1)), (1, 2))
]
# Must list what tests/workers/engine_cases.py runs after the plain cases.
EXTRAS = [dict(window=w) for w in (1, 7, 16, 24, 40, 1000)] + [dict(chunk=c) for c in (5, 16, 24, 40)]
EXTRAS += [dict(window=10, chunk=24), dict(v_dim=8), dict(v_dim=24), dict(dtype="float64"),
           dict(dtype="float64", window=24)]
EXTRAS += [dict(documents=d) for d in ("one_token", "spanning", "many_short", "whole", "mixed_rows")]
EXTRAS += [dict(documents="spanning", window=6)]
EXTRAS += [dict(hidden=h) for h in ("left", "right", "holes")] + [dict(hidden="left", documents="spanning"),
                                                                  dict(hidden="holes", window=7)]
CASES += [
    {"strategy": strategy, "causal": causal, "load_balance": load_balance, "q_heads": 4, "kv_heads": 2, "batch": 2,
     **extra}
    for strategy, causal, load_balance, extra in itertools.product(STRATEGIES, (True, False), (True, False), EXTRAS)
]
OPTIONS = ("window", "chunk", "v_dim", "dtype", "documents", "hidden")


def case_id(case: dict) -> str:
    options = [f"{name}{case[name]}" for name in OPTIONS if case.get(name) not in (None, "float32")]
    return "-".join([
        case["strategy"], "causal" if case["causal"] else "full", "balanced" if case["load_balance"] else "plain",
        f"heads{case['q_heads']}:{case['kv_heads']}", f"batch{case['batch']}", *options,
    ])


def key(case: dict) -> str:
    return case_id(case)


def run_worker(tmp: Path, pool) -> dict[str, dict]:
    """{case id: record} of one run of the worker in `pool`'s processes."""
    out = tmp / "cases.jsonl"
    pool.run(WORKER, str(out), cwd=tmp, timeout=TIMEOUT)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {key(record): record for record in lines} | {"__count__": len(lines)}


@pytest.fixture(scope="module")
def engine_records(tmp_path_factory: pytest.TempPathFactory, pools):
    """world size -> {case id: record}; each world size is run once, on first use, in the session's
    pool of that many processes (tests/pool.py)."""
    return launch_once(tmp_path_factory, "engine", lambda tmp, world: run_worker(tmp, pools[world]))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_worker_ran_every_case(engine_records, world: int) -> None:
    records = engine_records(world)
    assert records["__count__"] == len(CASES)  # a worker that skips or repeats cases fails here
    assert sorted(k for k in records if k != "__count__") == sorted(case_id(case) for case in CASES)
    for case in CASES:
        record = records[case_id(case)]
        assert (record["world"], record["dtype"]) == (world, case.get("dtype", "float32"))
        assert record["seq"] % (2 * world) == 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_single_process_sdpa(engine_records, world: int, case: dict) -> None:
    record = engine_records(world).get(case_id(case))
    assert record is not None, f"the worker did not run {case_id(case)} with {world} processes"
    errors = record["errors"]
    assert sorted(errors) == ["dk", "dq", "dv", "out"]
    assert all(error <= TOLERANCE for error in errors.values()), errors


def test_the_kernel_check_computes_its_reference_without_sdpa() -> None:
    """Inside maybe_context_parallel every SDPA call goes to the CP engine (at cp_size 1 too): the
    check of a kernel, which may run there at the first attention call, must not call SDPA itself
    (on one H200 it recursed into the engine in fp64 and refused every kernel)."""
    from cpctl.attention.dispatch import RouteSDPA
    from cpctl.attention.kernels import KERNELS, verify

    def engine(*args, **kwargs):
        raise AssertionError("the kernel check called SDPA")

    with RouteSDPA(engine):
        assert verify(KERNELS["cpu_flash"], device=torch.device("cpu"), dtype=torch.float32, head_dim=16) is None


class MadeTensors(TorchDispatchMode):
    """The sizes (numel) and dtypes of the tensors each op makes while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.extend((t.numel(), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def gqa_inputs():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 256, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 256, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v


def test_a_group_of_one_merges_nothing_in_fp32() -> None:
    """At cp 1 plain attention is one kernel call, whose gradients are the answer: its backward makes
    no fp32 buffer of q's or K/V's size. The block engine merged one part in such buffers (2 bytes of
    fp32 per bf16 byte), 3 GiB of the Llama-3.2-1B shape's 35 GiB peak at 256k on an H200."""
    from cpctl.attention import ChunkLayout, context_parallel_attention

    q, k, v = gqa_inputs()
    out = context_parallel_attention(q, k, v, group=None, layout=ChunkLayout(cp_size=1, cp_rank=0, load_balance=True),
                                     is_causal=True, enable_gqa=True)
    dout = torch.randn_like(out)
    with MadeTensors() as seen:
        out.backward(dout)
    assert max((n for n, dtype in seen.made if dtype == torch.float32), default=0) < k.numel(), seen.made

    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want.backward(dout)
    assert (out - want).abs().max() <= 2e-2
    for got, t in zip(grads, (q, k, v)):
        assert (got - t.grad).abs().max() <= 5e-2


def test_a_kernel_that_takes_gqa_gets_k_v_at_their_own_heads() -> None:
    """The CPU flash kernel computes GQA itself (`kernels.takes_gqa` checks each kernel once, as
    `verify` does): the block backward then makes one tensor of q's size, dq. Widened, K/V and
    their gradients were 4 more, the largest part of the backward at long lengths."""
    from cpctl.attention.kernels import KERNELS, block_backward, block_forward, seq_major, takes_gqa

    assert takes_gqa(KERNELS["cpu_flash"], torch.bfloat16, 16, torch.device("cpu"), 2)
    q, k, v = (seq_major(t.detach()) for t in gqa_inputs())
    out, lse = block_forward(q, k, v, causal=True, scale=0.25)
    dout = torch.randn_like(out)
    with MadeTensors() as seen:
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=True, scale=0.25)
    assert [n for n, _ in seen.made].count(q.numel()) == 1, seen.made
    assert (dk.shape, dv.shape) == (k.shape, v.shape)

    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=True, scale=0.25, enable_gqa=True)
    want.backward(dout)
    assert (out - want).abs().max() <= 2e-2
    for got, ref in zip((dq, dk, dv), refs):
        assert (got - ref.grad).abs().max() <= 5e-2


def test_the_gqa_check_refuses_a_kernel_that_groups_q_heads_otherwise() -> None:
    """`takes_gqa` checks with two K/V heads: a kernel that shared K/V heads among interleaved q heads
    (q head h on K/V head h % 2, not h // groups as expand_kv and Hugging Face's repeat_kv have it)
    would pass a check with one K/V head and be silently wrong on a model."""
    from cpctl.attention.kernels import KERNELS, Kernel, takes_gqa

    cpu = KERNELS["cpu_flash"]

    def interleaved(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads, groups = q.shape[1], q.shape[1] // k.shape[1]
        order = torch.arange(heads).view(heads // groups, groups).t().reshape(-1)
        return order, torch.argsort(order)

    def forward(q, k, v, *, causal, scale):
        order, back = interleaved(q, k)
        out, lse = cpu.forward(q[:, order], k, v, causal=causal, scale=scale)
        return out[:, back], lse[:, back]

    def backward(dout, q, k, v, out, lse, *, causal, scale):
        order, back = interleaved(q, k)
        dq, dk, dv = cpu.backward(dout[:, order], q[:, order], k, v, out[:, order], lse[:, order].contiguous(),
                                  causal=causal, scale=scale)
        return dq[:, back], dk, dv

    assert takes_gqa(cpu, torch.float32, 16, torch.device("cpu"), 4)
    assert not takes_gqa(Kernel("interleaved", forward, backward), torch.float32, 16, torch.device("cpu"), 4)
