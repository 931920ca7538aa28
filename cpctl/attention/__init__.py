"""cpctl's context-parallel attention engine: sharding, block planning, kernels, strategies."""

from cpctl.attention.engine import STRATEGIES, context_parallel_attention
from cpctl.attention.sharding import ChunkLayout, shard, unshard

__all__ = ["STRATEGIES", "ChunkLayout", "context_parallel_attention", "shard", "unshard"]
