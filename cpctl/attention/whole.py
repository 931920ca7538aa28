"""Attention over a whole sequence held by one rank: one fused kernel call, no partial results.

Where one rank holds every query and key of plain causal or full attention (Ulysses after its
all-to-all with no ring, or a CP group of one), the kernel's own output, log-sum-exp and
gradients are the answer. The block engine would split the work and merge the parts in fp32
buffers of q's and K/V's size (two bytes of fp32 per bf16 byte): at long lengths those buffers
are among the largest tensors of attention's backward, and here they would merge one part.
"""

from __future__ import annotations

import torch

from cpctl.attention.kernels import block_backward, block_forward, seq_major


class WholeSequenceAttention(torch.autograd.Function):
    """(batch, heads, seq, head_dim) q, k, v (k/v may have fewer heads: GQA) -> attention's output,
    through the engine's verified kernels (cuDNN first on CUDA, the flash CPU kernel on CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        q, k, v = seq_major(q), seq_major(k), seq_major(v)
        out, lse = block_forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(seq_major(dout), q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None
