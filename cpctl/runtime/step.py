"""One `maybe_context_parallel` step: its layout, padding, documents and the buffers to restore.

    step = Step(split, group=seq_group, seq_len=63, documents=None)   # plans padding and placement
    step.enter(buffers, seq_dims=[1, 1], pad_values=None, no_restore=[])  # shards them in place
    ...                                                                # the body: rt routes through it
    step.exit()                                                        # restores the others

The runtime holds a step only while its body runs (and while a checkpointed block of it
recomputes): outside, shards and gathers use the plain layout of `Step.plain(split)`, a step
with nothing appended and nothing packed. A finished step keeps its layout and padding, so that
its own results can still be gathered back (`step.unshard`).

Everything here but the gathers is local to this rank, so a step is built and checked for any
cp x sp coordinates in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cpctl import topology
from cpctl.attention import sharding
from cpctl.attention.sharding import ChunkLayout
from cpctl.attention.ulysses import sequence_layout
from cpctl.errors import CpctlError
from cpctl.runtime import documents as packing
from cpctl.runtime import padding

HiddenKeys = list[tuple[tuple[int, int], ...] | None] | None  # per batch row (one entry: every row)
RowMasks = tuple[list[packing.Starts] | None, HiddenKeys]


@dataclass(frozen=True)
class SequenceSplit:
    """Where this rank sits among the ranks that split one sequence (cp-major, sp inner)."""

    cp_size: int
    cp_rank: int
    sp_size: int = 1
    sp_rank: int = 0
    load_balance: bool = True  # the profile's cp_load_balance (head-tail chunks, cost-placed documents)

    @property
    def seq_size(self) -> int:
        return self.cp_size * self.sp_size

    def plain_ring(self) -> ChunkLayout:
        """Head-tail chunks (or plain ones); at cp_size 1 one chunk: there is no other rank to balance against."""
        return ChunkLayout(cp_size=self.cp_size, cp_rank=self.cp_rank,
                           load_balance=topology.head_tail(cp=self.cp_size, load_balance=self.load_balance))

    def tokens_of(self, ring: ChunkLayout) -> ChunkLayout:
        """The tokens this rank holds: the ring's chunks, each cut over the sp ranks (sp > 1)."""
        return sequence_layout(ring, sp_size=self.sp_size, sp_rank=self.sp_rank)


class Step:
    """One step's state, from the sharding of its buffers to their restoring."""

    def __init__(self, split: SequenceSplit, *, group: dist.ProcessGroup | None, seq_len: int,
                 documents: torch.Tensor | None) -> None:
        """Plan the step for rows of `seq_len` tokens: the padding the layout needs, and, for packed
        `documents` (full-length position ids), chunks placed on the ranks by cost."""
        self.split, self.group = split, group
        plain = split.plain_ring()
        self.padding = padding.plan(seq_len, divisor=split.tokens_of(plain).num_chunks)
        # Per row, the keys no query sees: the appended tokens, and the padding of the batch
        # (`hide_keys`); None: every key is seen.
        self.hidden_keys: HiddenKeys = self._with_appended(None)
        if self.padding is not None:
            if documents is not None:
                documents = padding.pad(documents, seq_dim=-1, padding=self.padding, value=padding.POSITIONS)
        self.ring_layout, self.placement = plain, None
        self.documents = None if documents is None else packing.documents_or_none(packing.starts_per_row(documents))
        if self.documents is not None and topology.head_tail(cp=split.cp_size, load_balance=split.load_balance):
            padded = self.padding.padded if self.padding is not None else seq_len
            split.tokens_of(plain).check_length(padded)
            self.placement = packing.place(self.documents, seq_len=padded, cp_size=split.cp_size,
                                           cp_rank=split.cp_rank, pieces=split.sp_size)
            self.ring_layout = self.placement.layout
        self.layout = split.tokens_of(self.ring_layout)
        self.seq_lengths: dict[int, int] = {}  # while entered: full length -> this rank's length, of every buffer
        self.local_length: int | None = None  # this rank's tokens (padding included), once entered
        self._restore: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._sharded_along: list[tuple[torch.Tensor, int]] = []  # while entered: each buffer and its seq dim

    @classmethod
    def plain(cls, split: SequenceSplit, *, group: dist.ProcessGroup | None) -> Step:
        """What holds outside any step: the plain layout, nothing appended, no documents."""
        return cls(split, group=group, seq_len=0, documents=None)

    @property
    def is_plain(self) -> bool:
        return self.padding is None and self.placement is None

    @property
    def balance(self) -> float | None:
        """The slowest rank's attention work over the mean (packed documents placed by cost; else None)."""
        return None if self.placement is None else self.placement.balance

    # ------------------------------------------------------------------ enter and exit

    def enter(self, buffers: Sequence[torch.Tensor], *, seq_dims: Sequence[int],
              pad_values: Sequence[padding.PadValue] | None, no_restore: Sequence[torch.Tensor]) -> None:
        """Shard `buffers` in place (padded at the end first, where the layout needs it); remember
        the caller's tensors of those not in `no_restore`, for `exit`."""
        values = list(pad_values) if pad_values is not None else [None] * len(buffers)
        with torch.no_grad():
            # Every shard first (each checks its length), so a bad buffer leaves none half-done.
            shards = [self.shard(self._padded(b, seq_dim=d, value=value), seq_dim=d)
                      for b, d, value in zip(buffers, seq_dims, values)]
            self.seq_lengths = {b.shape[d]: s.shape[d] for b, s, d in zip(buffers, shards, seq_dims)}
            if self.padding is not None and shards:
                self.seq_lengths[self.padding.padded] = shards[0].shape[seq_dims[0]]
            self.local_length = shards[0].shape[seq_dims[0]] if shards else None
            self._sharded_along = list(zip(buffers, seq_dims))
            for buffer, local in zip(buffers, shards):
                if local is buffer:
                    continue
                if not any(buffer is t for t in no_restore):
                    self._restore.append((buffer, _alias(buffer)))
                buffer.set_(local)

    def exit(self) -> None:
        """Put the caller's tensors back into the restored buffers; the step checks no more inputs."""
        self.seq_lengths, self._sharded_along = {}, []
        restore, self._restore = self._restore, []
        with torch.no_grad():
            for buffer, original in restore:
                buffer.set_(original)

    def hide_keys(self, rows: HiddenKeys) -> None:
        """The batch's padding, per row the [start, stop) ranges of its real positions that no
        query sees (a 2-D attention_mask's zeros), for the attention of the forward now running."""
        self.hidden_keys = self._with_appended(rows)

    def _with_appended(self, rows: HiddenKeys) -> HiddenKeys:
        """`rows` and the tokens this step appended, which no query of any row sees."""
        if self.padding is None:
            return rows
        appended = (self.padding.length, self.padding.padded)
        if rows is None:
            return [(appended,)]
        return [_joined(row or (), appended) for row in rows]

    @property
    def row_masks(self) -> RowMasks:
        """What attention in this step narrows per row: its packed documents and its hidden keys."""
        return self.documents, self.hidden_keys

    @row_masks.setter
    def row_masks(self, masks: RowMasks) -> None:
        self.documents, self.hidden_keys = masks

    # ------------------------------------------------------------------ shards and gathers

    def shard(self, tensor: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
        """This rank's shard of a full-length tensor (padded first when it has the step's unpadded
        length), as a new tensor; at seq_size 1 the tensor itself, which is its whole shard."""
        if self.split.seq_size == 1:
            return tensor
        if self.padding is not None and tensor.shape[seq_dim] == self.padding.length:
            tensor = padding.pad(tensor, seq_dim=seq_dim, padding=self.padding)
        return sharding.shard(tensor, seq_dim=seq_dim, layout=self.layout)

    def _padded(self, buffer: torch.Tensor, *, seq_dim: int, value: padding.PadValue) -> torch.Tensor:
        if self.padding is None or buffer.shape[seq_dim] != self.padding.length:
            return buffer  # nothing to append (a buffer of another length is checked by shard)
        return padding.pad(buffer, seq_dim=seq_dim, padding=self.padding, value=value)

    def gather_padded(self, tensor: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
        """The whole sequence from every rank's shard, in token order, with the appended tokens."""
        if self.split.seq_size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.split.seq_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return sharding.unshard(pieces, seq_dim=seq_dim, layout=self.layout)

    def unshard(self, tensor: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
        """`gather_padded` without the tokens the step appended."""
        return self.without_padding(self.gather_padded(tensor, seq_dim=seq_dim), seq_dim=seq_dim)

    def without_padding(self, full: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
        if self.padding is not None and full.shape[seq_dim] == self.padding.padded:
            return full.narrow(seq_dim, 0, self.padding.length)
        return full

    def unshard_results(self, outputs: Any) -> Any:
        """Tensors of this step's local length along dim 1 (alone or in tuples, lists, dicts),
        gathered whole in token order; anything else as it is."""
        if isinstance(outputs, torch.Tensor):
            if outputs.dim() >= 2 and outputs.shape[1] == self.local_length:
                return self.unshard(outputs, seq_dim=1)
            return outputs
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(self.unshard_results(item) for item in outputs)
        if isinstance(outputs, dict):
            return type(outputs)({key: self.unshard_results(item) for key, item in outputs.items()})
        return outputs

    def appended_in_shard(self, local_len: int, *, device: torch.device) -> torch.Tensor | None:
        """Which of this rank's `local_len` tokens the step appended (None: none)."""
        if self.padding is None or local_len * self.split.seq_size != self.padding.padded:
            return None
        index = torch.arange(self.padding.padded, device=device)
        return sharding.shard(index, seq_dim=0, layout=self.layout) >= self.padding.length

    def require_sharded(self, tensor: torch.Tensor | None, *, name: str, seq_dim: int) -> None:
        """While entered: `tensor` must have one of the step's local lengths along `seq_dim`."""
        if tensor is None or not self.seq_lengths or tensor.dim() <= seq_dim % max(tensor.dim(), 1):
            return
        length = tensor.shape[seq_dim]
        if length in self.seq_lengths.values():
            return
        along = next((dim for buffer, dim in self._sharded_along if buffer is tensor), None)
        if along is not None and along % tensor.dim() != seq_dim % tensor.dim():
            raise CpctlError(f"{name} is among the buffers but was sharded along dim {along}, while its tokens are "
                             f"along dim {seq_dim % tensor.dim()}: give it {seq_dim % tensor.dim()} in buffer_seq_dims")
        if length in self.seq_lengths:
            raise CpctlError(
                f"{name} has the full sequence length {length} inside maybe_context_parallel; add it to buffers "
                "(with its sequence dim) so it is sharded like the other inputs"
            )
        raise CpctlError(f"{name} has sequence length {length}, but this step's sharded buffers have "
                         f"{sorted(self.seq_lengths.values())} tokens per rank: check buffer_seq_dims (each "
                         "buffer's dim that holds its tokens: 1 for [batch, seq] inputs)")


def _joined(ranges: tuple[tuple[int, int], ...], last: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Ascending disjoint `ranges` (all before `last[0]`, or reaching it) with `last` added, touching ones merged."""
    if ranges and ranges[-1][1] >= last[0]:
        return (*ranges[:-1], (ranges[-1][0], max(ranges[-1][1], last[1])))
    return (*ranges, last)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A second handle on `tensor`'s current storage and shape, to put back after set_()."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
