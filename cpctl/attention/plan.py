"""Which (query block, key/value block) pairs a CP rank computes, as few kernel calls as possible.

Work is described at chunk granularity: each query chunk and key/value chunk has a global
index in the sequence. Under causal attention a query chunk sees earlier chunks fully,
its own chunk with a causal mask and later chunks not at all. Neighbouring chunks that see
the same thing are grouped so the kernel gets few, large blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Visibility(enum.Enum):
    NONE = 0
    FULL = 1
    DIAGONAL = 2  # the same chunk: causal mask, square block


@dataclass(frozen=True)
class Block:
    """Query chunks [q_start, q_stop) of the local buffer against K/V chunks [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool


def causal_visibility(q_chunk: int, kv_chunk: int) -> Visibility:
    if kv_chunk < q_chunk:
        return Visibility.FULL
    return Visibility.DIAGONAL if kv_chunk == q_chunk else Visibility.NONE


def full_visibility(q_chunk: int, kv_chunk: int) -> Visibility:
    return Visibility.FULL


def plan_blocks(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    visibility: Callable[[int, int], Visibility],
) -> list[Block]:
    """Blocks covering every visible pair once; positions index the local q and kv buffers."""
    blocks: list[Block] = []
    full_runs: list[tuple[int, int, int]] = []  # (q position, kv run start, kv run stop)
    for qi, q_chunk in enumerate(q_chunks):
        run_start = None
        for kj, kv_chunk in enumerate(list(kv_chunks) + [None]):
            seen = visibility(q_chunk, kv_chunk) if kv_chunk is not None else Visibility.NONE
            if seen is Visibility.DIAGONAL:
                blocks.append(Block(qi, qi + 1, kj, kj + 1, causal=True))
            if seen is Visibility.FULL and run_start is None:
                run_start = kj
            elif seen is not Visibility.FULL and run_start is not None:
                full_runs.append((qi, run_start, kj))
                run_start = None
    # Merge neighbouring query chunks that see the same K/V run into one block.
    for qi, start, stop in full_runs:
        last = blocks[-1] if blocks else None
        if (last is not None and not last.causal and last.q_stop == qi
                and (last.kv_start, last.kv_stop) == (start, stop)):
            blocks[-1] = Block(last.q_start, qi + 1, start, stop, causal=False)
        else:
            blocks.append(Block(qi, qi + 1, start, stop, causal=False))
    return blocks
