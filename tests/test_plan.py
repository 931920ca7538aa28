"""Pure tests of the CP engine's bookkeeping: no processes, no collectives, milliseconds.

Which (query chunk, key/value chunk) pairs the strategies' block plans compute, how a sequence
is sharded and put back, the length checks, the token helpers, and which masks the SDPA route
takes for plain causal attention.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import cpctl
from cpctl.attention import allgather, ring
from cpctl.attention.dispatch import RouteSDPA, is_causal_mask
from cpctl.attention.plan import Block
from cpctl.attention.sharding import ChunkLayout, shard, unshard
from cpctl.attention.spec import AttentionSpec
from cpctl.errors import CpctlError

CP_SIZES = range(1, 9)


def spec(cp_size: int, rank: int, *, load_balance: bool, causal: bool) -> AttentionSpec:
    # Planning reads only the layout and causality; the group is not touched.
    layout = ChunkLayout(cp_size=cp_size, cp_rank=rank, load_balance=load_balance)
    return AttentionSpec(group=None, layout=layout, causal=causal, scale=1.0, strategy="allgather")


def covered(blocks: list[Block], q_chunks, kv_chunks) -> Counter:
    """(global q chunk, global kv chunk, how) for every pair a plan's blocks compute.

    A causal block is a token-level lower triangle over its square: positions below the
    diagonal are full pairs, the diagonal is a masked pair (right only for the same chunk),
    positions above it compute nothing.
    """
    pairs: Counter = Counter()
    for block in blocks:
        if block.causal:
            assert (block.q_start, block.q_stop) == (block.kv_start, block.kv_stop), f"causal block not square: {block}"
        for i in range(block.q_start, block.q_stop):
            for j in range(block.kv_start, block.kv_stop):
                if not block.causal or j < i:
                    pairs[q_chunks[i], kv_chunks[j], "full"] += 1
                elif j == i:
                    pairs[q_chunks[i], kv_chunks[j], "diagonal"] += 1
    return pairs


def expected_pairs(num_chunks: int, *, causal: bool) -> Counter:
    if not causal:
        return Counter((q, kv, "full") for q in range(num_chunks) for kv in range(num_chunks))
    full = Counter((q, kv, "full") for q in range(num_chunks) for kv in range(q))
    return full + Counter((q, q, "diagonal") for q in range(num_chunks))


def ring_coverage(cp_size: int, *, load_balance: bool, causal: bool) -> Counter:
    pairs: Counter = Counter()
    for rank in range(cp_size):
        s = spec(cp_size, rank, load_balance=load_balance, causal=causal)
        for step in range(cp_size):  # the ring visits every rank's K/V once
            source = (rank - step) % cp_size
            pairs += covered(ring._plan(s, source), s.layout.local_chunks, s.layout.chunks_of(source))
    return pairs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "plain"])
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_ring_plans_cover_every_visible_pair_once(cp_size: int, load_balance: bool, causal: bool) -> None:
    num_chunks = ChunkLayout(cp_size=cp_size, cp_rank=0, load_balance=load_balance).num_chunks
    assert ring_coverage(cp_size, load_balance=load_balance, causal=causal) == expected_pairs(num_chunks, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "plain"])
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_allgather_plans_cover_every_visible_pair_once(cp_size: int, load_balance: bool, causal: bool) -> None:
    forward: Counter = Counter()
    backward: Counter = Counter()
    for rank in range(cp_size):
        s = spec(cp_size, rank, load_balance=load_balance, causal=causal)
        local_chunks = s.layout.local_chunks
        local, remote = allgather._local_plan(s), allgather._remote_plan(s)
        # local blocks index this rank's own K/V; remote ones the gathered K/V in sequence order
        remote_pairs = covered(remote, local_chunks, range(s.layout.num_chunks))
        forward += covered(local, local_chunks, local_chunks) + remote_pairs
        # the backward splits the local work into finer blocks; together they must match too
        fine = allgather._local_plan(s, causal_squares=False)
        backward += covered(fine, local_chunks, local_chunks) + remote_pairs
    expected = expected_pairs(s.layout.num_chunks, causal=causal)
    assert forward == expected
    assert backward == expected


def test_a_balanced_rank_computes_its_own_kv_in_one_causal_call() -> None:
    # head-tail shards keep global order locally: chunks (r, 2cp-1-r) are one causal square
    for cp_size in CP_SIZES:
        for rank in range(cp_size):
            local = allgather._local_plan(spec(cp_size, rank, load_balance=True, causal=True))
            assert local == [Block(0, 2, 0, 2, causal=True)]


def test_balanced_ranks_do_equal_causal_work() -> None:
    for cp_size in CP_SIZES:
        work = []
        for rank in range(cp_size):
            s = spec(cp_size, rank, load_balance=True, causal=True)
            pairs: Counter = Counter()
            for step in range(cp_size):
                source = (rank - step) % cp_size
                pairs += covered(ring._plan(s, source), s.layout.local_chunks, s.layout.chunks_of(source))
            work.append(sum(n * (1.0 if how == "full" else 0.5) for (_, _, how), n in pairs.items()))  # in chunk areas
        assert len(set(work)) == 1, (cp_size, work)


# ---------------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "plain"])
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_shard_unshard_round_trip(cp_size: int, load_balance: bool) -> None:
    layouts = [ChunkLayout(cp_size=cp_size, cp_rank=r, load_balance=load_balance) for r in range(cp_size)]
    seq = 2 * cp_size * 3
    x = torch.arange(2 * seq * 5).view(2, seq, 5)
    for seq_dim, tensor in ((1, x), (0, x[0]), (-1, x.transpose(1, 2)), (2, x.transpose(1, 2))):
        shards = [shard(tensor, seq_dim=seq_dim, layout=layout) for layout in layouts]
        for layout in layouts:  # any rank's layout object reassembles the same sequence
            assert torch.equal(unshard(shards, seq_dim=seq_dim, layout=layout), tensor)
    # which tokens a rank holds: chunk r, and with load balance also chunk 2cp-1-r
    tokens = torch.arange(seq)
    chunk = seq // layouts[0].num_chunks
    for rank, layout in enumerate(layouts):
        chunks = [rank, 2 * cp_size - 1 - rank] if load_balance else [rank]
        expected = torch.cat([tokens[c * chunk:(c + 1) * chunk] for c in chunks])
        assert torch.equal(shard(tokens, seq_dim=0, layout=layout), expected)
    assert sorted(layouts[0].rank_order()) == list(range(layouts[0].num_chunks))


def test_check_length_names_the_divisor_and_the_fix() -> None:
    balanced = ChunkLayout(cp_size=4, cp_rank=0, load_balance=True)
    plain = ChunkLayout(cp_size=3, cp_rank=0, load_balance=False)
    balanced.check_length(16)
    plain.check_length(9)
    with pytest.raises(CpctlError) as info:
        balanced.check_length(20)
    assert "20" in str(info.value) and "2 * cp_size (8)" in str(info.value) and "pad the sequence to 24" in str(info.value)
    with pytest.raises(CpctlError) as info:
        plain.check_length(10)
    message = str(info.value)
    assert "10" in message and "cp_size (3)" in message and "2 * cp_size" not in message
    assert "pad the sequence to 12" in message
    with pytest.raises(CpctlError, match=r"2 \* cp_size \(4\)"):
        shard(torch.zeros(1, 6), seq_dim=1, layout=ChunkLayout(cp_size=2, cp_rank=1, load_balance=True))


# ----------------------------------------------------------------------------- token helpers


def test_shift_labels() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert cpctl.shift_labels(ids).tolist() == [[6, 7, 8, -100], [2, 3, 4, -100]]
    assert cpctl.shift_labels(ids, ignore_index=-1).tolist() == [[6, 7, 8, -1], [2, 3, 4, -1]]
    assert ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]  # the input is not touched


def test_position_ids_like() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    pos = cpctl.position_ids_like(ids)
    assert pos.tolist() == [[0, 1, 2, 3, 4]] * 2
    pos[0, 0] = 9  # a dense tensor of its own (it gets sharded in place), not an expanded view
    assert pos.tolist() == [[9, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


# --------------------------------------------------------------------------------- masks


def causal_bool(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def additive(allowed: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, fill)


def test_causal_masks_are_recognised() -> None:
    n = 6
    assert is_causal_mask(causal_bool(n), n, n)
    assert is_causal_mask(causal_bool(n).expand(2, 3, n, n), n, n)  # per batch and head
    assert is_causal_mask(additive(causal_bool(n)), n, n)
    assert is_causal_mask(additive(causal_bool(n), torch.finfo(torch.float32).min)[None, None], n, n)  # HF style


def test_other_masks_are_not_causal() -> None:
    n = 6
    shifted = causal_bool(n).clone()
    shifted[3, 4] = True  # one future token visible
    padded = causal_bool(n).clone()
    padded[:, 0] = False  # left padding
    per_batch = torch.stack([causal_bool(n), padded])[:, None]
    window = causal_bool(n).triu(-2)  # sliding window
    for mask in (torch.ones(n, n, dtype=torch.bool), shifted, padded, per_batch, window, additive(window),
                 additive(torch.ones(n, n, dtype=torch.bool))):
        assert not is_causal_mask(mask, n, n)
    assert not is_causal_mask(causal_bool(n), n, n + 1)  # shape does not fit the call
    assert not is_causal_mask(torch.ones(n, n + 2, dtype=torch.bool).tril(), n, n + 2)  # not square


def test_route_takes_a_causal_mask_as_is_causal_and_rejects_others() -> None:
    calls = []

    def engine(q, k, v, *, is_causal, scale, enable_gqa):  # stands in for rt.attention
        calls.append((is_causal, scale, enable_gqa))
        return q

    q = torch.randn(1, 2, 4, 8)
    with RouteSDPA(engine):
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal_bool(4))
        F.scaled_dot_product_attention(q, q, q, attn_mask=additive(causal_bool(4)), scale=0.5)
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], None, 0.0, True, enable_gqa=True)
        with pytest.raises(CpctlError, match="attn_mask=None"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(CpctlError, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    assert calls == [(True, None, False), (True, 0.5, False), (True, None, True)]
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))  # outside: untouched
    assert len(calls) == 3
