"""Packed documents under CP: where they start, and a layout that balances their cost.

A packed row holds several documents back to back; its position ids restart at 0 (or, as
transformers reads them, jump by anything but 1) where a document starts. Attention stays
inside a document, so a rank's work follows the squares of the document lengths it holds,
and head-tail chunks, balanced for one causal sequence, are not for a mix of lengths: the
chunks are then assigned by cost (`cpctl.attention.sharding.cost_balanced`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpctl.attention.masks import Mask
from cpctl.attention.sharding import ChunkLayout, balance, cost_balanced

Starts = tuple[int, ...]
# Chunks per rank tried for a cost-balanced layout, fewest (largest kernel calls) first; the
# first within BALANCE_GOAL of perfect wins, else the most even.
CHUNKS_PER_RANK = (2, 4, 8, 16)
BALANCE_GOAL = 1.05


def starts_per_row(position_ids: torch.Tensor) -> list[Starts]:
    """Document starts of each row of full-length (batch, seq) or (seq,) position ids."""
    rows = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    jumps = rows.diff(dim=-1) != 1
    return [(0, *(int(i) + 1 for i in jump.nonzero().flatten())) for jump in jumps]


def documents_or_none(rows: list[Starts]) -> list[Starts] | None:
    """None when every row is a single document (plain attention, nothing to mask)."""
    return None if all(row == (0,) for row in rows) else rows


@dataclass(frozen=True)
class Placement:
    layout: ChunkLayout
    balance: float  # slowest rank's attention work / mean, for this layout
    head_tail_balance: float  # the same for the default head-tail layout


def place(rows: list[Starts], *, seq_len: int, cp_size: int, cp_rank: int, pieces: int = 1) -> Placement:
    """The cost-balanced layout for rows packed as `rows` (their work summed). `pieces`: how many
    parts each chunk is cut into afterwards (sp_size under Ulysses), so the length must divide by that too."""
    masks = [Mask(documents=row) for row in rows]

    def costs(num_chunks: int) -> list[int]:
        length = seq_len // num_chunks
        return [sum(m.row_cost(c * length, (c + 1) * length, seq_len=seq_len) for m in masks) for c in range(num_chunks)]

    head_tail = ChunkLayout(cp_size=cp_size, cp_rank=cp_rank, load_balance=True)
    fixed = costs(head_tail.num_chunks)
    head_tail_balance = balance([sum(fixed[c] for c in head_tail.chunks_of(r)) for r in range(cp_size)])
    best = None
    for per_rank in CHUNKS_PER_RANK:
        if seq_len % (per_rank * cp_size * pieces):
            break
        layout, achieved = cost_balanced(costs(per_rank * cp_size), cp_size=cp_size, cp_rank=cp_rank)
        if best is None or achieved < best.balance:
            best = Placement(layout, achieved, head_tail_balance)
        if achieved <= BALANCE_GOAL:
            break
    if best is None or best.balance >= head_tail_balance:
        return Placement(head_tail, head_tail_balance, head_tail_balance)
    return best
