"""Pure tests of the CP engine's bookkeeping: no processes, no collectives, milliseconds.

Which (query chunk, key/value chunk) pairs the strategies' block plans compute, how a sequence
is sharded and put back, the length checks, the token helpers, the strategy names, and what
the SDPA route takes (plain causal masks, nn.MultiheadAttention) and refuses.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import cpctl
from cpctl.attention import STRATEGIES, allgather, context_parallel_attention, ring
from cpctl.attention.dispatch import RouteSDPA, is_causal_mask
from cpctl.attention.masks import Mask, Visibility, tiles
from cpctl.attention.plan import Block
from cpctl.attention.sharding import ChunkLayout, shard, unshard
from cpctl.attention.spec import AttentionSpec, Strategy
from cpctl.errors import CpctlError

CP_SIZES = range(1, 9)


def spec(cp_size: int, rank: int, *, load_balance: bool, causal: bool, window: int | None = None,
         chunk: int | None = None, documents: tuple[int, ...] | None = None, chunk_len: int = 4,
         assignment: tuple[tuple[int, ...], ...] | None = None) -> AttentionSpec:
    # Planning reads only the layout and the mask; the group is not touched.
    layout = ChunkLayout(cp_size=cp_size, cp_rank=rank, load_balance=load_balance, assignment=assignment)
    mask = Mask(causal=causal, window=window, chunk=chunk, documents=documents)
    return AttentionSpec(group=None, layout=layout, mask=mask, scale=1.0, strategy="allgather", chunk_len=chunk_len)


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
            pairs += covered(ring.plan(s, source), s.layout.local_chunks, s.layout.chunks_of(source))
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
        local, remote = allgather.local_plan(s), allgather.remote_plan(s)
        # local blocks index this rank's own K/V; remote ones the gathered K/V in sequence order
        remote_pairs = covered(remote, local_chunks, range(s.layout.num_chunks))
        forward += covered(local, local_chunks, local_chunks) + remote_pairs
        # the backward splits the local work into finer blocks; together they must match too
        fine = allgather.local_plan(s, causal_squares=False)
        backward += covered(fine, local_chunks, local_chunks) + remote_pairs
    expected = expected_pairs(s.layout.num_chunks, causal=causal)
    assert forward == expected
    assert backward == expected


def test_a_balanced_rank_computes_its_own_kv_in_one_causal_call() -> None:
    # head-tail shards keep global order locally: chunks (r, 2cp-1-r) are one causal square
    for cp_size in CP_SIZES:
        for rank in range(cp_size):
            local = allgather.local_plan(spec(cp_size, rank, load_balance=True, causal=True))
            assert local == [Block(0, 2, 0, 2, causal=True)]


def test_balanced_ranks_do_equal_causal_work() -> None:
    for cp_size in CP_SIZES:
        work = []
        for rank in range(cp_size):
            s = spec(cp_size, rank, load_balance=True, causal=True)
            pairs: Counter = Counter()
            for step in range(cp_size):
                source = (rank - step) % cp_size
                pairs += covered(ring.plan(s, source), s.layout.local_chunks, s.layout.chunks_of(source))
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
    with pytest.raises(CpctlError, match="sequence length 0 under context parallelism: there is nothing to split"):
        balanced.check_length(0)  # plain SDPA returns an empty tensor; a shard of nothing would divide by zero
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


def test_documents_aware_token_helpers() -> None:
    pos = cpctl.position_ids_for_documents([[3, 1, 2], [2, 4]])
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 0, 1, 2, 3]]
    assert cpctl.position_ids_for_documents([2, 2]).tolist() == [[0, 1, 0, 1]]  # one row
    document_ids = torch.tensor([[7, 7, 7, 3, 9, 9], [1, 1, 5, 5, 5, 5]])
    assert torch.equal(cpctl.position_ids_from_document_ids(document_ids), pos)
    ids = torch.arange(10, 22).view(2, 6)
    # no document's last token predicts the next document's first
    assert cpctl.shift_labels(ids, position_ids=pos).tolist() == [[11, 12, -100, -100, 15, -100],
                                                                  [17, -100, 19, 20, 21, -100]]
    assert cpctl.shift_labels(ids, position_ids=cpctl.position_ids_like(ids)).tolist() == cpctl.shift_labels(ids).tolist()
    with pytest.raises(ValueError, match="add up to one length"):
        cpctl.position_ids_for_documents([[3, 1], [2]])
    with pytest.raises(ValueError, match="positive"):
        cpctl.position_ids_for_documents([[3, 0]])


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
    with RouteSDPA(engine, cp_size=2):
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


def test_multihead_attention_is_routed_without_patching_torch() -> None:
    sdpa = F.scaled_dot_product_attention
    unpatched = []

    def engine(q, k, v, *, is_causal, scale, enable_gqa):  # stands in for rt.attention
        unpatched.append(F.scaled_dot_product_attention is sdpa)  # what another thread would call now
        return sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    reference = mha(x, x, x, need_weights=False)[0]
    with RouteSDPA(engine, cp_size=2):
        routed = mha(x, x, x, need_weights=False)[0]
        with pytest.raises(CpctlError, match="need_weights=False"):
            mha(x, x, x)
    assert unpatched == [True]
    assert torch.allclose(routed, reference)


def test_a_shard_mean_cross_entropy_under_cp_is_one_line() -> None:
    """The shards count different tokens (-100 labels, padding): the mean of their means is not the
    sequence's. Sums are what rt.token_mean makes the sequence's mean; at cp 1 a mean is the row's."""
    logits, labels = torch.randn(2 * 8, 10), torch.randint(10, (2 * 8,))  # 2 rows of 8 local tokens

    def engine(*args, **kwargs):
        raise AssertionError("no attention here")

    with RouteSDPA(engine, cp_size=2, local_tokens=8):
        F.cross_entropy(logits, labels, reduction="sum")
        F.cross_entropy(logits, labels, reduction="none")
        F.cross_entropy(logits[:3], labels[:3])  # not one per token of the rows: a pooled head's loss
        for mean in (lambda: F.cross_entropy(logits, labels), lambda: F.nll_loss(logits.log_softmax(-1), labels),
                     lambda: F.cross_entropy(logits, labels, None, True)):  # legacy size_average=True
            with pytest.raises(CpctlError, match="reduction='mean' inside maybe_context_parallel averages this rank"):
                mean()
    with RouteSDPA(engine, cp_size=1, local_tokens=8):
        F.cross_entropy(logits, labels)


def test_strategies_are_one_enum_that_takes_plain_names() -> None:
    assert [s.value for s in Strategy] == ["allgather", "alltoall"]
    assert STRATEGIES[Strategy("alltoall")] is ring and STRATEGIES[Strategy.ALLGATHER] is allgather
    assert spec(2, 0, load_balance=True, causal=True).strategy is Strategy.ALLGATHER  # given as "allgather"
    layout = ChunkLayout(cp_size=2, cp_rank=0, load_balance=True)
    with pytest.raises(CpctlError, match="cp_comm_strategy 'ring': choose one of allgather, alltoall"):
        AttentionSpec(group=None, layout=layout, mask=Mask(), scale=1.0, strategy="ring", chunk_len=4)
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(CpctlError, match="cp_comm_strategy 'ring'"):
        context_parallel_attention(q, q, q, group=None, layout=layout, strategy="ring")


# ------------------------------------------------------------------- windows and chunked attention


def token_pairs(blocks: list[Block], q_chunks, kv_chunks, s: AttentionSpec) -> torch.Tensor:
    """How often each (query, key) token pair of the sequence is computed by `blocks`."""
    c, n = s.chunk_len, s.seq_len
    count = torch.zeros(n, n, dtype=torch.int64)

    def positions(chunks, start, stop):
        return torch.cat([torch.arange(chunks[i] * c, (chunks[i] + 1) * c) for i in range(start, stop)])

    for block in blocks:
        q_pos, k_pos = positions(q_chunks, block.q_start, block.q_stop), positions(kv_chunks, block.kv_start, block.kv_stop)
        if not block.partial:
            hit = torch.ones(len(q_pos), len(k_pos), dtype=torch.int64)
            if block.causal:
                hit = hit.tril()
            count[q_pos[:, None], k_pos[None, :]] += hit
            continue
        for tile in tiles(s.mask, q_start=block.q_chunk * c, k_start=block.kv_chunk * c, q_len=c, k_len=c, seq_len=n):
            tq, tk = q_pos[tile.q0:tile.q1], k_pos[tile.k0:tile.k1]
            if tile.kind is Visibility.FULL:
                hit = torch.ones(len(tq), len(tk), dtype=torch.int64)
            elif tile.kind is Visibility.DIAGONAL:
                assert torch.equal(tq, tk), tile
                hit = torch.ones(len(tq), len(tk), dtype=torch.int64).tril()
            else:
                assert tile.q1 - tile.q0 <= 256 and tile.k1 - tile.k0 <= 256
                hit = s.mask.dense(tq, tk, seq_len=n).long()
            count[tq[:, None], tk[None, :]] += hit
    return count


def reference_mask(n: int, *, causal: bool, window: int | None, chunk: int | None,
                   documents: tuple[int, ...] | None = None) -> torch.Tensor:
    """Written out independently of masks.Mask, as Hugging Face's mask functions define it (with packed
    documents, on the positions within each document: chunks count from a document's start)."""
    position = torch.arange(n)
    doc = torch.zeros(n, dtype=torch.long)
    for start in [s for s in (documents or (0,))[1:] if s < n]:
        doc[start:] += 1
        position[start:] -= position[start].clone()
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (k <= q) if causal else torch.ones(n, n, dtype=torch.bool)
    if window is not None:
        allowed &= (k > q - window) if causal else ((q - k).abs() < window)
    if chunk is not None:
        allowed &= position[None, :] // chunk == position[:, None] // chunk
    allowed &= doc[:, None] == doc[None, :]
    return allowed


MASKS = [dict(window=w, chunk=None) for w in (1, 3, 4, 5, 9, 17, 100)] + [dict(window=None, chunk=ch) for ch in (1, 3, 4, 6, 8, 13)]
MASKS.append(dict(window=6, chunk=10))
# packed documents: one-token documents, documents across chunk and rank boundaries, one long one
DOCUMENTS = [(0, 1, 2, 7, 13, 14, 30), (0, 5), tuple(range(0, 64, 3)), (0, 4, 8, 12, 16, 20, 24, 28)]
MASKS += [dict(window=None, chunk=None, documents=d) for d in DOCUMENTS] + [dict(window=5, chunk=None, documents=DOCUMENTS[0])]
# chunks inside documents count from each document's start (Llama 4 on packed rows)
MASKS += [dict(window=None, chunk=4, documents=DOCUMENTS[0]), dict(window=None, chunk=6, documents=DOCUMENTS[2]),
          dict(window=3, chunk=5, documents=DOCUMENTS[0])]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"window{m['window']}-chunk{m['chunk']}-docs{len(m.get('documents') or ())}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "plain"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_masked_plans_cover_exactly_the_visible_token_pairs_once(cp_size, load_balance, causal, mask) -> None:
    ring_count = allgather_count = backward_count = None
    for rank in range(cp_size):
        s = spec(cp_size, rank, load_balance=load_balance, causal=causal, **mask)
        local = s.layout.local_chunks
        ring_part = sum(token_pairs(ring.plan(s, source), local, s.layout.chunks_of(source), s)
                        for source in range(cp_size))
        remote = token_pairs(allgather.remote_plan(s), local, range(s.layout.num_chunks), s)
        gather_part = token_pairs(allgather.local_plan(s), local, local, s) + remote
        fine_part = token_pairs(allgather.local_plan(s, causal_squares=False), local, local, s) + remote
        ring_count = ring_part if ring_count is None else ring_count + ring_part
        allgather_count = gather_part if allgather_count is None else allgather_count + gather_part
        backward_count = fine_part if backward_count is None else backward_count + fine_part
    expected = reference_mask(s.seq_len, causal=causal, **mask).long()
    assert torch.equal(ring_count, expected)
    assert torch.equal(allgather_count, expected)
    assert torch.equal(backward_count, expected)


def test_a_window_skips_the_blocks_it_hides() -> None:
    # 8 chunks of 1024 tokens, window 1024: each query chunk needs its own and the previous chunk only
    s = spec(4, 0, load_balance=True, causal=True, window=1024, chunk_len=1024)
    visible = [[s.visibility(qc, kc) for kc in range(8)] for qc in range(8)]
    for qc in range(8):
        assert [kc for kc in range(8) if visible[qc][kc] is not Visibility.NONE] == [kc for kc in (qc - 1, qc) if kc >= 0]
    # the cut chunk pair is a few large kernel calls plus small explicit tiles along the window's edge only
    pieces = tiles(s.mask, q_start=1024, k_start=0, q_len=1024, k_len=1024, seq_len=8192)
    explicit = [t for t in pieces if t.kind is Visibility.PARTIAL]
    area = sum((t.q1 - t.q0) * (t.k1 - t.k0) for t in explicit)
    assert area <= 1024 * 1024 // 4 and len(pieces) < 40


def test_masks_refuse_nonsense_sizes() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            Mask(window=bad)
        with pytest.raises(ValueError, match="positive integer"):
            Mask(chunk=bad)


@pytest.mark.parametrize("explicit_tile", [1, 2, 5, 8])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"window{m['window']}-chunk{m['chunk']}-docs{len(m.get('documents') or ())}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tiles_of_a_cut_block_cover_its_visible_pairs_once(causal, mask, explicit_tile) -> None:
    n, length = 96, 32
    reference = reference_mask(n, causal=causal, **mask)
    m = Mask(causal=causal, **mask)
    for q_start, k_start in ((32, 32), (64, 32), (32, 64), (64, 0), (0, 0)):
        count = torch.zeros(length, length, dtype=torch.int64)
        for tile in tiles(m, q_start=q_start, k_start=k_start, q_len=length, k_len=length, seq_len=n,
                          explicit_tile=explicit_tile):
            rows, cols = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
            if tile.kind is Visibility.FULL:
                count[rows, cols] += 1
            elif tile.kind is Visibility.DIAGONAL:
                assert q_start + tile.q0 == k_start + tile.k0 and tile.q1 - tile.q0 == tile.k1 - tile.k0
                count[rows, cols] += torch.ones(tile.q1 - tile.q0, tile.k1 - tile.k0, dtype=torch.int64).tril()
            else:
                assert tile.q1 - tile.q0 <= explicit_tile and tile.k1 - tile.k0 <= explicit_tile
                count[rows, cols] += reference[q_start + tile.q0:q_start + tile.q1, k_start + tile.k0:k_start + tile.k1].long()
        expected = reference[q_start:q_start + length, k_start:k_start + length].long()
        assert torch.equal(count, expected), (q_start, k_start)



@pytest.mark.parametrize("documents", DOCUMENTS)
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_cost_balanced_layouts_cover_every_visible_pair_once(cp_size: int, documents) -> None:
    from cpctl.attention.sharding import cost_balanced

    chunks_per_rank, chunk_len = 4, 4
    n = cp_size * chunks_per_rank * chunk_len
    mask = Mask(documents=documents)
    costs = [mask.row_cost(c * chunk_len, (c + 1) * chunk_len, seq_len=n) for c in range(n // chunk_len)]
    layout, _ = cost_balanced(costs, cp_size=cp_size, cp_rank=0)
    assert sorted(c for rank in range(cp_size) for c in layout.chunks_of(rank)) == list(range(n // chunk_len))
    assert all(len(layout.chunks_of(rank)) == chunks_per_rank for rank in range(cp_size))
    ring_count = gather_count = 0
    for rank in range(cp_size):
        s = spec(cp_size, rank, load_balance=True, causal=True, documents=documents, chunk_len=chunk_len,
                 assignment=layout.assignment)
        local = s.layout.local_chunks
        ring_count = ring_count + sum(token_pairs(ring.plan(s, source), local, s.layout.chunks_of(source), s)
                                      for source in range(cp_size))
        gather_count = gather_count + token_pairs(allgather.local_plan(s), local, local, s) + token_pairs(
            allgather.remote_plan(s), local, range(s.layout.num_chunks), s)
    expected = reference_mask(n, causal=True, window=None, chunk=None, documents=documents).long()
    assert torch.equal(ring_count, expected) and torch.equal(gather_count, expected)


def test_row_cost_counts_visible_pairs() -> None:
    for mask in (Mask(), Mask(window=5), Mask(chunk=6), Mask(documents=DOCUMENTS[0]), Mask(causal=False, window=3),
                 Mask(causal=False, documents=(0, 5, 9)), Mask(chunk=4, documents=(0, 3, 13)),
                 Mask(causal=False, chunk=4, documents=(0, 3, 13))):
        n = 40
        dense = mask.dense(torch.arange(n), torch.arange(n), seq_len=n)
        for start, stop in ((0, n), (3, 17), (20, 21)):
            assert mask.row_cost(start, stop, seq_len=n) == int(dense[start:stop].sum())


def test_cost_balancing_evens_out_long_tailed_documents() -> None:
    from cpctl.attention.sharding import balance, cost_balanced

    torch.manual_seed(0)
    n, cp_size, chunk_len = 65536, 4, 1024
    for _ in range(5):
        # long-tailed document lengths (log-normal), packed into one sequence
        lengths = torch.distributions.LogNormal(7.5, 1.2).sample((200,)).clamp(min=1).long()
        starts = [0]
        for length in lengths.tolist():
            if starts[-1] + length >= n:
                break
            starts.append(starts[-1] + length)
        mask = Mask(documents=tuple(starts))
        costs = [mask.row_cost(c * chunk_len, (c + 1) * chunk_len, seq_len=n) for c in range(n // chunk_len)]
        head_tail = ChunkLayout(cp_size=cp_size, cp_rank=0, load_balance=True)
        big = n // head_tail.num_chunks
        fixed = balance([sum(mask.row_cost(c * big, (c + 1) * big, seq_len=n) for c in head_tail.chunks_of(r))
                         for r in range(cp_size)])
        _, balanced = cost_balanced(costs, cp_size=cp_size, cp_rank=0)
        assert balanced <= 1.02, balanced
        assert balanced <= fixed
