"""A small Llama-style decoder in plain PyTorch, for the examples and benchmarks.

RMSNorm, rotary embeddings driven by explicit position ids (so a sequence shard keeps its
true positions), grouped-query attention through `F.scaled_dot_product_attention`, SwiGLU.
Random weights; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS = {
    "tiny": LlamaConfig(),
    # About 1.1B parameters (Llama-3.2-1B shape, smaller vocabulary): for the GPU benchmarks.
    "1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (B, S, H, D) by the angles of each token's true position."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = position_ids.float()[..., None] * inv_freq  # (B, S, D/2)
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        cfg = self.cfg
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = rotary(self.q_proj(x).view(b, s, -1, cfg.head_dim), position_ids, cfg.rope_theta)
        k = rotary(self.k_proj(x).view(b, s, -1, cfg.head_dim), position_ids, cfg.rope_theta)
        v = self.v_proj(x).view(b, s, -1, cfg.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=cfg.n_kv_heads != cfg.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU, token by token (so it can run over the sequence in tiles)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), MLP(cfg)

    def forward(self, x, position_ids):
        x = x + self.attn(self.attn_norm(x), position_ids)
        return x + self.mlp(self.mlp_norm(x))


def tp_plan() -> dict:
    """Megatron-style tensor parallelism for `Llama`: heads and MLP columns split over tp ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up"):
        plan[f"layers.*.{name}"] = ColwiseParallel()
    for name in ("attn.o_proj", "mlp.down"):
        plan[f"layers.*.{name}"] = RowwiseParallel()
    return plan


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, *, hidden_only: bool = False):
        """Logits; or, with hidden_only, the final hidden states (for a loss that never holds the logits)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids)
        hidden = self.norm(x)
        return hidden if hidden_only else self.head(hidden)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters + causal attention (fwd + bwd)."""
        matmul_params = sum(p.numel() for n, p in self.named_parameters() if "norm" not in n and "embed" not in n)
        attention = 6 * self.cfg.n_layers * self.cfg.dim * seq_len  # 12 * L * d * S, halved by causality
        return 6 * matmul_params + attention


class SyntheticSequences(torch.utils.data.Dataset):
    """Token sequences with a learnable rule (each sequence counts up by its own stride)."""

    def __init__(self, *, length: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.length, self.seq_len, self.vocab_size, self.seed = length, seq_len, vocab_size, seed

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(self.vocab_size, (1,), generator=gen)
        stride = torch.randint(1, 8, (1,), generator=gen)
        tokens = (start + stride * torch.arange(self.seq_len)) % self.vocab_size
        noise = torch.rand(self.seq_len, generator=gen) < 0.1
        tokens[noise] = torch.randint(self.vocab_size, (int(noise.sum()),), generator=gen)
        return {"input_ids": tokens}
