"""cpctl's context-parallel attention engine: sharding, block planning, kernels, strategies."""

from cpctl.attention.engine import STRATEGIES, context_parallel_attention
from cpctl.attention.sharding import ChunkLayout, shard, unshard
from cpctl.attention.spec import Strategy

__all__ = ["STRATEGIES", "ChunkLayout", "Strategy", "context_parallel_attention", "shard", "unshard"]
