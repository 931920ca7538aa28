"""How a sequence is cut into chunks and which chunks each CP rank holds.

Without load balancing the sequence is cut into `cp` chunks and rank r holds chunk r. With
causal attention that leaves rank 0 almost idle and rank cp-1 with most of the work, so
with load balancing (head-tail sharding) the sequence is cut into `2 * cp` chunks and rank r
holds chunks r and 2*cp-1-r: every rank then has the same amount of causal work.

Packed documents break that symmetry (work follows the squares of the document lengths), so
for them the chunks can be assigned by cost instead (`cost_balanced`): any assignment works,
as long as every rank holds as many chunks as the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpctl.errors import CpctlError


@dataclass(frozen=True)
class ChunkLayout:
    cp_size: int
    cp_rank: int
    load_balance: bool
    assignment: tuple[tuple[int, ...], ...] | None = None  # chunks per rank, ascending; None: the fixed ones
    divisor_reason: str | None = None  # what num_chunks is, for errors; None: said from the fields above

    @property
    def num_chunks(self) -> int:
        if self.assignment is not None:
            return sum(len(chunks) for chunks in self.assignment)
        return 2 * self.cp_size if self.load_balance else self.cp_size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices held by `rank`, in the order they sit in its local shard."""
        if self.assignment is not None:
            return self.assignment[rank]
        if self.load_balance:
            return (rank, 2 * self.cp_size - 1 - rank)
        return (rank,)

    @property
    def local_chunks(self) -> tuple[int, ...]:
        return self.chunks_of(self.cp_rank)

    def rank_order(self) -> list[int]:
        """Global chunk indices in the order an all-gather over ranks lays them out."""
        return [chunk for rank in range(self.cp_size) for chunk in self.chunks_of(rank)]

    def check_length(self, seq_len: int, *, what: str = "sequence length") -> None:
        if seq_len == 0:
            raise CpctlError(f"{what} 0 under context parallelism: there is nothing to split; skip empty "
                             "sequences, or run them outside maybe_context_parallel")
        if seq_len % self.num_chunks:
            if self.divisor_reason is not None:
                reason = self.divisor_reason
            elif self.assignment is not None:
                reason = f"the {self.num_chunks} chunks of the cost-balanced layout"
            elif self.load_balance:
                reason = f"2 * cp_size ({self.num_chunks}) with cp_load_balance"
            else:
                reason = f"cp_size ({self.cp_size})"
            fit = (seq_len // self.num_chunks + 1) * self.num_chunks
            raise CpctlError(
                f"{what} {seq_len} is not divisible by {reason}; pad the sequence to {fit} tokens "
                f"or choose another {'cp_size or sp_size' if self.divisor_reason else 'cp_size'}"
            )


def shard(tensor: torch.Tensor, *, seq_dim: int, layout: ChunkLayout) -> torch.Tensor:
    """This rank's shard of a full-length tensor, as a new tensor."""
    layout.check_length(tensor.shape[seq_dim])
    chunks = tensor.chunk(layout.num_chunks, dim=seq_dim)
    return torch.cat([chunks[i] for i in layout.local_chunks], dim=seq_dim)


def unshard(gathered_shards: list[torch.Tensor], *, seq_dim: int, layout: ChunkLayout) -> torch.Tensor:
    """Reassemble the full sequence, in original token order, from every rank's shard."""
    pieces: dict[int, torch.Tensor] = {}
    for rank, piece in enumerate(gathered_shards):
        ids = layout.chunks_of(rank)
        for chunk_id, chunk in zip(ids, piece.chunk(len(ids), dim=seq_dim)):
            pieces[chunk_id] = chunk
    return torch.cat([pieces[i] for i in range(layout.num_chunks)], dim=seq_dim)


def cost_balanced(costs: list[int], *, cp_size: int, cp_rank: int) -> tuple[ChunkLayout, float]:
    """A layout giving each rank len(costs) / cp_size chunks with loads as even as possible,
    and its balance (slowest rank's work / mean work; 1.0 is perfect).

    Longest-processing-time first: the costliest chunk goes to the least loaded rank that
    still has room. Each rank's chunks stay in sequence order, so neighbours merge into
    single kernel calls.
    """
    per_rank = len(costs) // cp_size
    loads, held = [0] * cp_size, [[] for _ in range(cp_size)]
    for chunk in sorted(range(len(costs)), key=lambda c: (-costs[c], c)):
        rank = min((r for r in range(cp_size) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        held[rank].append(chunk)
        loads[rank] += costs[chunk]
    layout = ChunkLayout(cp_size=cp_size, cp_rank=cp_rank, load_balance=True,
                         assignment=tuple(tuple(sorted(chunks)) for chunks in held))
    return layout, balance(loads)


def balance(loads: list[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
