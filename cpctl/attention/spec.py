"""What one CP attention call needs to know besides its tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from cpctl.attention.masks import Mask, Visibility
from cpctl.attention.plan import mask_visibility
from cpctl.attention.sharding import ChunkLayout
from cpctl.strategy import Strategy


@dataclass(frozen=True)
class AttentionSpec:
    group: dist.ProcessGroup
    layout: ChunkLayout
    mask: Mask
    scale: float
    strategy: Strategy
    chunk_len: int  # tokens per chunk of the layout

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))

    @property
    def seq_len(self) -> int:
        return self.chunk_len * self.layout.num_chunks

    @property
    def visibility(self) -> Callable[[int, int], Visibility]:
        return mask_visibility(self.mask, chunk_len=self.chunk_len, num_chunks=self.layout.num_chunks)
