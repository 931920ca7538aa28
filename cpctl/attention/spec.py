"""What one CP attention call needs to know besides its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from cpctl.attention.sharding import ChunkLayout


@dataclass(frozen=True)
class AttentionSpec:
    group: dist.ProcessGroup
    layout: ChunkLayout
    causal: bool
    scale: float
    strategy: str  # "allgather" | "alltoall"
