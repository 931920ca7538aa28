"""Which keys a query sees, in global token positions, and how a block of pairs splits into kernel calls.

Every mask cpctl computes gives each query row one interval of visible keys, [lo(q), hi(q)],
with lo and hi never decreasing as q grows: causal, sliding windows (Mistral, Gemma 3),
chunked attention (Llama 4) and packed documents, each causal or bidirectional, and any
intersection of them. That shape is what makes a
rectangle of (query, key) pairs cheap to classify from a few rows: fully visible, hidden,
a causal square the fused kernels compute with `is_causal`, or partial. A partial rectangle
is split in halves until every piece is one of the first three or small enough for an
explicitly masked tile.

Padding (an attention_mask's zeros: left, right or holes) hides keys from every query, as
transformers reads a 2-D mask: `hidden` key ranges. A rectangle's keys are first cut at those
ranges, so every piece is again an interval mask over visible keys only, and padding costs
no explicit tiles. A query that sees no key at all (a left-padding token) gets output 0 and
log-sum-exp -inf, as SDPA gives a fully masked row.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass

import torch


class Visibility(enum.Enum):
    NONE = 0
    FULL = 1
    DIAGONAL = 2  # q and kv are the same positions and the mask is causal on them
    PARTIAL = 3  # anything else: computed in tiles


@dataclass(frozen=True)
class Mask:
    """Query q sees key k iff lo(q) <= k <= hi(q); positions count from the sequence start.

    `window`: q sees the `window` keys ending at itself (Hugging Face's sliding_window:
    k > q - window), and as many after it when not causal. `chunk`: q sees only keys of its
    own `chunk`-token chunk. `documents`: the first position of every document packed into
    the sequence (0 first, ascending); q sees only keys of its own document, and chunks count
    from the document's start (as transformers reads packed position ids, and as each document
    alone would be chunked). Each narrows the visible interval. `hidden`: key ranges
    [start, stop) (ascending, disjoint) that no query sees: the padding of the row.
    """

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    documents: tuple[int, ...] | None = None
    hidden: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"mask {name} must be a positive integer, got {value!r}")
        starts = self.documents
        if starts is not None and (not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))):
            raise ValueError("mask documents must be ascending document start positions beginning with 0")
        ranges = self.hidden
        if ranges is not None and (not ranges or any(start < 0 or stop <= start for start, stop in ranges)
                                   or any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:]))):
            raise ValueError("mask hidden keys must be ascending, disjoint, non-empty [start, stop) ranges "
                             "with a visible key between each two")

    @property
    def is_plain(self) -> bool:
        return self.window is None and self.chunk is None and self.documents is None and self.hidden is None

    def visible_key_ranges(self, k0: int, k1: int) -> list[tuple[int, int]]:
        """The keys of [k0, k1) that some query may see: [k0, k1) cut at the hidden ranges."""
        pieces, start = [], k0
        for h0, h1 in self.hidden or ():
            if h1 <= start:
                continue
            if h0 >= k1:
                break
            if h0 > start:
                pieces.append((start, h0))
            start = max(start, h1)
        if start < k1:
            pieces.append((start, k1))
        return pieces

    def _start(self, q: int) -> int:
        """Where q's document starts (0 without documents)."""
        return 0 if self.documents is None else self.documents[bisect.bisect_right(self.documents, q) - 1]

    def lo(self, q: int) -> int:
        start = self._start(q)
        lo = start
        if self.window is not None:
            lo = max(lo, q - self.window + 1)
        if self.chunk is not None:
            lo = max(lo, start + (q - start) // self.chunk * self.chunk)
        return lo

    def hi(self, q: int, seq_len: int) -> int:
        if self.causal:
            return q
        hi = seq_len - 1
        if self.window is not None:
            hi = min(hi, q + self.window - 1)
        if self.chunk is not None:
            start = self._start(q)
            hi = min(hi, start + ((q - start) // self.chunk + 1) * self.chunk - 1)
        if self.documents is not None:
            following = bisect.bisect_right(self.documents, q)
            if following < len(self.documents):
                hi = min(hi, self.documents[following] - 1)
        return hi

    def row_cost(self, q_start: int, q_stop: int, *, seq_len: int) -> int:
        """How many (query, key) pairs the queries [q_start, q_stop) see: their attention work."""
        q = torch.arange(q_start, q_stop, dtype=torch.int64)
        start, end = torch.zeros_like(q), torch.full_like(q, seq_len)  # q's document
        if self.documents is not None:
            starts = torch.tensor([*self.documents, seq_len], dtype=torch.int64)
            index = torch.searchsorted(starts, q, right=True)
            start, end = starts[index - 1], starts[index]
        lo, hi = start.clone(), q.clone() if self.causal else end - 1
        if self.window is not None:
            lo = torch.maximum(lo, q - self.window + 1)
            if not self.causal:
                hi = torch.minimum(hi, q + self.window - 1)
        if self.chunk is not None:
            lo = torch.maximum(lo, start + (q - start) // self.chunk * self.chunk)
            if not self.causal:
                hi = torch.minimum(hi, start + ((q - start) // self.chunk + 1) * self.chunk - 1)
        return int((hi - lo + 1).sum())

    def classify(self, q0: int, q1: int, k0: int, k1: int, *, seq_len: int) -> Visibility:
        """The rectangle of queries [q0, q1) and keys [k0, k1), from its corner rows (lo, hi monotone).

        Keys cut by hidden ranges make it PARTIAL (or NONE): `tiles` cuts them off first."""
        if self.hidden is not None:
            pieces = self.visible_key_ranges(k0, k1)
            if all(self._sees_nothing(q0, q1, a, b, seq_len) for a, b in pieces):
                return Visibility.NONE
            if pieces != [(k0, k1)]:
                return Visibility.PARTIAL
        if self._sees_nothing(q0, q1, k0, k1, seq_len):
            return Visibility.NONE
        if self.lo(q1 - 1) <= k0 and self.hi(q0, seq_len) >= k1 - 1:
            return Visibility.FULL
        if self.causal and (q0, q1) == (k0, k1) and self.lo(q1 - 1) <= k0:
            return Visibility.DIAGONAL
        return Visibility.PARTIAL

    def bounding_box(self, q0: int, q1: int, k0: int, k1: int, *, seq_len: int) -> tuple[int, int, int, int]:
        """The smallest sub-rectangle holding every visible pair of a rectangle that has one."""
        # Rows that see something run from the first whose interval reaches k0 to before the
        # first whose interval starts past k1 - 1 (both ends move forward only).
        first = _first(q0, q1, lambda q: self.hi(q, seq_len) >= k0)
        stop = _first(first, q1, lambda q: self.lo(q) > k1 - 1)
        return first, stop, max(k0, self.lo(first)), min(k1, self.hi(stop - 1, seq_len) + 1)

    def _sees_nothing(self, q0: int, q1: int, k0: int, k1: int, seq_len: int) -> bool:
        # Rows whose interval ends before k0 form a prefix, rows whose interval starts after
        # k1 - 1 a suffix; the rectangle is hidden iff the two cover every row.
        prefix_end = _first(q0, q1, lambda q: self.hi(q, seq_len) >= k0)
        suffix_start = _first(q0, q1, lambda q: self.lo(q) > k1 - 1)
        return suffix_start <= prefix_end

    def dense(self, q_pos: torch.Tensor, k_pos: torch.Tensor, *, seq_len: int) -> torch.Tensor:
        """The boolean (len(q_pos), len(k_pos)) mask of explicit positions."""
        q, k = q_pos[:, None], k_pos[None, :]
        visible = k <= q if self.causal else torch.ones_like(q, dtype=torch.bool) & (k < seq_len)
        if self.window is not None:
            visible = visible & (k > q - self.window)
            if not self.causal:
                visible = visible & (k < q + self.window)
        q_start, k_start = torch.zeros_like(q), torch.zeros_like(k)
        if self.documents is not None:
            starts = torch.tensor(self.documents, device=q_pos.device)
            doc_of = lambda pos: torch.searchsorted(starts, pos, right=True)  # noqa: E731
            visible = visible & (doc_of(k) == doc_of(q))
            q_start, k_start = starts[doc_of(q) - 1], starts[doc_of(k) - 1]
        if self.chunk is not None:
            visible = visible & ((k - k_start) // self.chunk == (q - q_start) // self.chunk)
        for h0, h1 in self.hidden or ():
            visible = visible & ((k < h0) | (k >= h1))
        return visible


def _first(start: int, stop: int, predicate) -> int:
    """The first q in [start, stop) where a monotone (False..True) predicate holds, else stop."""
    while start < stop:
        mid = (start + stop) // 2
        if predicate(mid):
            stop = mid
        else:
            start = mid + 1
    return start


@dataclass(frozen=True)
class Tile:
    """Rows [q0, q1) x keys [k0, k1) of a block, offsets into it; `kind` FULL, DIAGONAL or PARTIAL."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: Visibility


# A partial tile at most this many rows and keys is computed with an explicit mask: small
# enough that its score matrix is cheap, large enough that long windows need few of them.
EXPLICIT_TILE = 256


def tiles(mask: Mask, *, q_start: int, k_start: int, q_len: int, k_len: int, seq_len: int,
          explicit_tile: int = EXPLICIT_TILE) -> list[Tile]:
    """Split the block of queries [q_start, +q_len) x keys [k_start, +k_len) into kernel-ready tiles.

    Hidden pieces are dropped, so work follows the visible area, not the block's. Keys are
    first cut at the mask's hidden ranges; within each visible range the mask is an interval.
    """
    out: list[Tile] = []

    def visit(q0: int, q1: int, k0: int, k1: int) -> None:
        kind = mask.classify(q_start + q0, q_start + q1, k_start + k0, k_start + k1, seq_len=seq_len)
        if kind is Visibility.NONE:
            return
        if kind is Visibility.PARTIAL:
            # Shrink to the pairs' bounding box first: a document or window edge that runs
            # along a whole side then costs nothing, and only corners need explicit tiles.
            box = mask.bounding_box(q_start + q0, q_start + q1, k_start + k0, k_start + k1, seq_len=seq_len)
            box = (box[0] - q_start, box[1] - q_start, box[2] - k_start, box[3] - k_start)
            if box != (q0, q1, k0, k1):
                visit(*box)
                return
        if kind is not Visibility.PARTIAL or (q1 - q0 <= explicit_tile and k1 - k0 <= explicit_tile):
            out.append(Tile(q0, q1, k0, k1, kind))
            return
        # Halve the longer side; a square on the diagonal is halved on both, so the causal
        # squares along it are found.
        if q1 - q0 >= k1 - k0:
            mid = (q0 + q1) // 2
            halves = [(q0, mid, k0, k1), (mid, q1, k0, k1)]
        else:
            mid = (k0 + k1) // 2
            halves = [(q0, q1, k0, mid), (q0, q1, mid, k1)]
        if q_start + q0 == k_start + k0 and q1 - q0 == k1 - k0:
            qm, km = (q0 + q1) // 2, (k0 + k1) // 2
            halves = [(q0, qm, k0, km), (q0, qm, km, k1), (qm, q1, k0, km), (qm, q1, km, k1)]
        for piece in halves:
            visit(*piece)

    for a, b in mask.visible_key_ranges(k_start, k_start + k_len):
        visit(0, q_len, a - k_start, b - k_start)
    return out
