"""Running a plan of blocks: forward with exact log-sum-exp merging, backward into gradient buffers."""

from __future__ import annotations

import torch

from cpctl.attention.kernels import block_backward, block_forward
from cpctl.attention.plan import Block


class ForwardAccumulator:
    """Partial attention results of one rank's queries, merged exactly with their LSE.

    Merging in fp32: new_lse = logaddexp(lse, lse_b); out = out * e^(lse - new) + out_b * e^(lse_b - new).
    `logaddexp` is stable where the naive log(1 + exp(.)) overflows. A chunk's first block is
    copied, not merged.
    """

    def __init__(self, q: torch.Tensor, *, chunk_len: int, num_chunks: int):
        b, h, s, d = q.shape
        self.out = torch.empty(b, h, s, d, dtype=torch.float32, device=q.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        self.chunk_len = chunk_len
        self.written = [False] * num_chunks

    def add(self, block: Block, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        rows = slice(block.q_start * self.chunk_len, block.q_stop * self.chunk_len)
        chunks = range(block.q_start, block.q_stop)
        if not any(self.written[c] for c in chunks):
            self.out[:, :, rows].copy_(out_b)
            self.lse[:, :, rows].copy_(lse_b)
        else:
            out, lse = self.out[:, :, rows], self.lse[:, :, rows]
            new_lse = torch.logaddexp(lse, lse_b)
            out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
            out.add_(out_b.float() * torch.exp(lse_b - new_lse).unsqueeze(-1))
            lse.copy_(new_lse)
        for c in chunks:
            self.written[c] = True


def forward_blocks(acc: ForwardAccumulator, blocks: list[Block], q, k, v, *, scale: float) -> None:
    c = acc.chunk_len
    for blk in blocks:
        kv_rows = slice(blk.kv_start * c, blk.kv_stop * c)
        out_b, lse_b = block_forward(
            q[:, :, blk.q_start * c: blk.q_stop * c], k[:, :, kv_rows], v[:, :, kv_rows],
            causal=blk.causal, scale=scale,
        )
        acc.add(blk, out_b, lse_b)


def backward_blocks(
    blocks: list[Block], *, dout, q, k, v, out, lse, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    chunk_len: int, scale: float,
) -> None:
    """Add each block's gradients into dq (local queries) and dk/dv (the K/V buffer given)."""
    c = chunk_len
    for blk in blocks:
        rows = slice(blk.q_start * c, blk.q_stop * c)
        kv_rows = slice(blk.kv_start * c, blk.kv_stop * c)
        dq_b, dk_b, dv_b = block_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, kv_rows], v[:, :, kv_rows], out[:, :, rows],
            lse[:, :, rows], causal=blk.causal, scale=scale,
        )
        dq[:, :, rows] += dq_b
        dk[:, :, kv_rows] += dk_b
        dv[:, :, kv_rows] += dv_b
