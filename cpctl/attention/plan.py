"""Which (query block, key/value block) pairs a CP rank computes, as few kernel calls as possible.

Work is described at chunk granularity: each query chunk and key/value chunk has a global
index in the sequence. Under causal attention a query chunk sees earlier chunks fully,
its own chunk with a causal mask and later chunks not at all. Neighbouring chunks that see
the same thing are grouped so the kernel gets few, large blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cpctl.attention.masks import Mask, Visibility


@dataclass(frozen=True)
class Block:
    """Query chunks [q_start, q_stop) of the local buffer against K/V chunks [kv_start, kv_stop).

    A `partial` block is one chunk pair that a window or chunked mask cuts through; it keeps
    the pair's global chunk indices, from which its tiles are planned.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool
    partial: bool = False
    q_chunk: int = -1
    kv_chunk: int = -1


def causal_visibility(q_chunk: int, kv_chunk: int) -> Visibility:
    if kv_chunk < q_chunk:
        return Visibility.FULL
    return Visibility.DIAGONAL if kv_chunk == q_chunk else Visibility.NONE


def full_visibility(q_chunk: int, kv_chunk: int) -> Visibility:
    return Visibility.FULL


def mask_visibility(mask: Mask, *, chunk_len: int, num_chunks: int) -> Callable[[int, int], Visibility]:
    """Visibility of chunk pairs under `mask`, for chunks of `chunk_len` tokens."""
    if mask.is_plain:
        return causal_visibility if mask.causal else full_visibility
    seq_len = chunk_len * num_chunks

    def visibility(q_chunk: int, kv_chunk: int) -> Visibility:
        return mask.classify(q_chunk * chunk_len, (q_chunk + 1) * chunk_len, kv_chunk * chunk_len,
                             (kv_chunk + 1) * chunk_len, seq_len=seq_len)

    return visibility


def plan_blocks(
    q_chunks: Sequence[int],
    kv_chunks: Sequence[int],
    visibility: Callable[[int, int], Visibility],
    *,
    causal_squares: bool = True,
) -> list[Block]:
    """Blocks covering every visible pair once; positions index the local q and kv buffers.

    A run of positions where q and kv hold the same ascending chunks and every pair is
    causal (earlier chunks full, own chunk diagonal, later chunks hidden) is one causal
    block over the run: head-tail shards keep global order locally, so a rank's own K/V
    is one causal call. The remaining fully visible pairs are grouped into runs. With
    `causal_squares=False` each diagonal pair is its own block instead: finer units of work,
    for overlapping communication in the backward.
    """
    seen = [[visibility(qc, kc) for kc in kv_chunks] for qc in q_chunks]
    blocks: list[Block] = []
    for qi, row in enumerate(seen):
        for kj, vis in enumerate(row):
            if vis is Visibility.PARTIAL:
                blocks.append(Block(qi, qi + 1, kj, kj + 1, causal=False, partial=True,
                                    q_chunk=q_chunks[qi], kv_chunk=kv_chunks[kj]))
                row[kj] = Visibility.NONE
    squares = _causal_squares(q_chunks, kv_chunks, seen)
    if not causal_squares:
        squares = [(i, i + 1) for start, stop in squares for i in range(start, stop)]
    for start, stop in squares:
        blocks.append(Block(start, stop, start, stop, causal=True))
        for i in range(start, stop):
            for j in range(start, stop):
                seen[i][j] = Visibility.NONE
    full_runs: list[tuple[int, int, int]] = []  # (q position, kv run start, kv run stop)
    for qi, row in enumerate(seen):
        run_start = None
        for kj, vis in enumerate([*row, Visibility.NONE]):
            if vis is Visibility.DIAGONAL:
                raise ValueError(f"diagonal pair ({q_chunks[qi]}, {kv_chunks[kj]}) outside a causal square")
            if vis is Visibility.FULL and run_start is None:
                run_start = kj
            elif vis is not Visibility.FULL and run_start is not None:
                full_runs.append((qi, run_start, kj))
                run_start = None
    # Merge neighbouring query chunks that see the same K/V run into one block.
    merged: list[Block] = []
    for qi, start, stop in full_runs:
        last = merged[-1] if merged else None
        if last is not None and last.q_stop == qi and (last.kv_start, last.kv_stop) == (start, stop):
            merged[-1] = Block(last.q_start, qi + 1, start, stop, causal=False)
        else:
            merged.append(Block(qi, qi + 1, start, stop, causal=False))
    return blocks + merged


def _is_causal_square(seen, start: int, stop: int) -> bool:
    expected = {True: Visibility.FULL, False: Visibility.NONE}
    return all(
        seen[i][j] is (Visibility.DIAGONAL if i == j else expected[j < i])
        for i in range(start, stop) for j in range(start, stop)
    )


def _causal_squares(q_chunks, kv_chunks, seen) -> list[tuple[int, int]]:
    """Maximal runs [start, stop) of diagonal positions that form one causal block."""
    squares: list[tuple[int, int]] = []
    i, n = 0, min(len(q_chunks), len(kv_chunks))
    while i < len(q_chunks):
        if i < n and seen[i][i] is Visibility.DIAGONAL:
            stop = i + 1
            while stop < n and seen[stop][stop] is Visibility.DIAGONAL and _is_causal_square(seen, i, stop + 1):
                stop += 1
            squares.append((i, stop))
            i = stop
        else:
            i += 1
    return squares
