"""One maybe_context_parallel step's state (cpctl/runtime/step.py), in this process: no launch.

A step's sharding, padding and placement are local to each rank, so every rank of a cp x sp
split is built here side by side, and their shards put back together (the gather's own
assembly, `sharding.unshard` over the pieces in rank order) must be the original tensor.
What is checked: what a step shards and pads, where it places packed documents, what it
restores on exit and what it keeps (only what its results need).
"""

from __future__ import annotations

import pytest
import torch

import cpctl
from cpctl.attention import sharding
from cpctl.errors import CpctlError
from cpctl.runtime.step import SequenceSplit, Step

LONG_TAILED = [[25, 3, 2, 2]]  # one long document first: head-tail chunks leave rank 1 with 1.57x rank 0's work


def steps(*, cp: int, sp: int = 1, seq_len: int, documents: torch.Tensor | None = None,
          load_balance: bool = True) -> list[Step]:
    """The step of every rank of a cp x sp split (cp-major, sp inner, as the sequence group numbers them)."""
    return [Step(SequenceSplit(cp_size=cp, cp_rank=c, sp_size=sp, sp_rank=s, load_balance=load_balance), group=None,
                 seq_len=seq_len, documents=documents)
            for c in range(cp) for s in range(sp)]


def put_together(ranks: list[Step], shards: list[torch.Tensor], *, seq_dim: int) -> torch.Tensor:
    """What each rank's gather makes of the shards of every rank (padding dropped)."""
    full = [sharding.unshard(shards, seq_dim=seq_dim, layout=step.layout) for step in ranks]
    assert all(torch.equal(f, full[0]) for f in full)  # every rank reads the same sequence
    return ranks[0].without_padding(full[0], seq_dim=seq_dim)


@pytest.mark.parametrize(("cp", "sp"), [(2, 1), (3, 1), (1, 2), (2, 2)])
def test_a_length_the_layout_does_not_divide_is_padded_at_the_end_and_dropped_again(cp: int, sp: int) -> None:
    ranks = steps(cp=cp, sp=sp, seq_len=45)
    chunks = ranks[0].layout.num_chunks  # 2 x cp (load balance, cp > 1) x sp
    assert chunks == (2 * cp if cp > 1 else 1) * sp
    padded = -(-45 // chunks) * chunks
    assert all(step.padding is not None and (step.padding.length, step.padding.padded) == (45, padded)
               for step in ranks)
    assert all(step.hidden_keys == [((45, padded),)] for step in ranks)  # no query sees the appended tokens
    ranks[0].hide_keys([((0, 3),), None, ((40, 45),)])  # a batch's padding joins them, row by row
    assert ranks[0].hidden_keys == [((0, 3), (45, padded)), ((45, padded),), ((40, padded),)]
    ids = torch.arange(2 * 45).view(2, 45)
    shards = [step.shard(ids, seq_dim=1) for step in ranks]
    assert {tuple(s.shape) for s in shards} == {(2, padded // (cp * sp))}
    assert torch.equal(put_together(ranks, shards, seq_dim=1), ids)
    # Which tokens are the appended ones, rank by rank: exactly the positions from 45 on.
    appended = [step.appended_in_shard(padded // (cp * sp), device=torch.device("cpu")) for step in ranks]
    positions = [step.shard(torch.arange(padded), seq_dim=0) for step in ranks]
    for mask, held in zip(appended, positions):
        assert torch.equal(mask, held >= 45)


def test_entering_shards_the_buffers_in_place_and_exit_restores_the_callers_tensors() -> None:
    rank0 = steps(cp=2, seq_len=45)[0]  # chunks 0 and 3 of 4 x 12 tokens: tokens 0-11 and 36-47
    ids = torch.arange(45).view(1, 45)
    labels = torch.cat([torch.arange(1, 45), torch.tensor([-100])]).view(1, 45)
    pos = cpctl.position_ids_like(ids)
    storage = ids.untyped_storage().data_ptr()
    rank0.enter([ids, labels, pos], seq_dims=[1, 1, 1], pad_values=None, no_restore=[pos])
    held = [*range(12), *range(36, 48)]
    assert ids.tolist() == [[min(t, 44) for t in held]]  # token ids repeat the last one
    assert labels.tolist() == [[t + 1 if t < 44 else -100 for t in held]]  # labels (they hold -100) get -100
    assert pos.tolist() == [[min(t, 44) for t in held]]
    assert rank0.seq_lengths == {45: 24, 48: 24} and rank0.local_length == 24
    with pytest.raises(CpctlError, match="full sequence length 45"):
        rank0.require_sharded(torch.zeros(1, 45), name="labels", seq_dim=1)
    rank0.require_sharded(torch.zeros(1, 24), name="labels", seq_dim=1)
    rank0.exit()
    assert ids.tolist() == [list(range(45))] and ids.untyped_storage().data_ptr() == storage
    assert labels.shape == (1, 45) and pos.shape == (1, 24)  # a no_restore buffer keeps its shard
    assert rank0.seq_lengths == {}  # a finished step checks no inputs
    rank0.require_sharded(torch.zeros(1, 45), name="labels", seq_dim=1)
    # It keeps what its results need: a result of 24 tokens per rank still drops the appended ones.
    assert rank0.padding is not None and rank0.local_length == 24


def test_pad_values_say_what_to_append() -> None:
    rank0 = steps(cp=2, seq_len=45)[0]
    x, y, pos = torch.arange(45).view(1, 45), torch.arange(1, 46).view(1, 45), torch.arange(45).view(1, 45)
    rank0.enter([x, y, pos], seq_dims=[1, 1, 1], pad_values=[None, -100, "positions"], no_restore=[x, y, pos])
    assert x[0, -3:].tolist() == [44, 44, 44]
    assert y[0, -3:].tolist() == [-100, -100, -100]
    assert pos[0, -3:].tolist() == [45, 46, 47]


def test_a_buffer_of_another_length_leaves_none_half_sharded() -> None:
    rank0 = steps(cp=2, seq_len=16)[0]
    ids, other = torch.arange(16).view(1, 16), torch.arange(6).view(1, 6)
    with pytest.raises(CpctlError, match="sequence length 6"):
        rank0.enter([ids, other], seq_dims=[1, 1], pad_values=None, no_restore=[])
    assert ids.tolist() == [list(range(16))] and other.tolist() == [list(range(6))]


@pytest.mark.parametrize(("cp", "sp"), [(2, 1), (2, 2), (4, 1)])
def test_packed_documents_are_placed_by_cost_and_put_back_in_token_order(cp: int, sp: int) -> None:
    pos = cpctl.position_ids_for_documents([[length * 2 for length in LONG_TAILED[0]]] * 2)  # 64 tokens, 2 rows
    ranks = steps(cp=cp, sp=sp, seq_len=64, documents=pos)
    placed = ranks[0].placement
    assert placed is not None and placed.balance < placed.head_tail_balance
    assert all(step.ring_layout.assignment == placed.layout.assignment for step in ranks)  # every rank agrees
    assert ranks[0].documents == [(0, 50, 56, 60)] * 2 and ranks[0].balance == placed.balance
    assert ranks[0].is_plain is False
    ids = torch.arange(2 * 64).view(2, 64)
    assert torch.equal(put_together(ranks, [step.shard(ids, seq_dim=1) for step in ranks], seq_dim=1), ids)


def test_packed_documents_are_not_placed_at_cp_1_or_without_load_balance() -> None:
    pos = cpctl.position_ids_for_documents(LONG_TAILED)
    for ranks in (steps(cp=1, sp=2, seq_len=32, documents=pos), steps(cp=2, seq_len=32, documents=pos, load_balance=False)):
        assert all(step.placement is None and step.documents == [(0, 25, 28, 30)] for step in ranks)
        assert ranks[0].ring_layout == ranks[0].split.plain_ring()


def test_documents_of_a_padded_step_continue_their_positions() -> None:
    pos = cpctl.position_ids_for_documents([[20, 1, 24]])  # 45 tokens: the last document goes on to 48
    assert steps(cp=2, seq_len=45, documents=pos)[0].documents == [(0, 20, 21)]


def test_the_plain_step_is_what_holds_outside_any_step() -> None:
    for rank in range(2):
        plain = Step.plain(SequenceSplit(cp_size=2, cp_rank=rank), group=None)
        assert plain.is_plain and plain.padding is None and plain.row_masks == (None, None)
        assert plain.layout.local_chunks == (rank, 3 - rank)  # head-tail
        assert plain.shard(torch.arange(8), seq_dim=0).tolist() == [2 * rank, 2 * rank + 1, 6 - 2 * rank, 7 - 2 * rank]


def test_at_seq_size_1_a_step_shards_nothing() -> None:
    (step,) = steps(cp=1, seq_len=45, documents=cpctl.position_ids_for_documents([[20, 25]]))
    ids = torch.arange(45).view(1, 45)
    assert step.padding is None and step.placement is None and step.documents == [(0, 20)]
    assert step.shard(ids, seq_dim=1) is ids and step.gather_padded(ids, seq_dim=1) is ids
    step.enter([ids], seq_dims=[1], pad_values=None, no_restore=[])
    assert ids.tolist() == [list(range(45))] and step.local_length == 45
    step.exit()
